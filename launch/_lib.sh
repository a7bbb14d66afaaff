# shellcheck shell=bash
# Shared helpers for launch/tpu_vm.sh and launch/gke_xpk.sh (sourced, not run).
#
# Every external command goes through `run`: it prints the command as one line, "+ " followed by
# the words quoted for a POSIX shell (so `shlex.split(line[2:])` gives the exact argv back), and
# runs it unless DRY_RUN=1. Dry-run lines go to stdout; in a real run they go to stderr (like
# `set -x`) so that the commands' own output stays on stdout. Notes start with "# ".

DRY_RUN=${DRY_RUN:-0}
PROG=${PROG:-$(basename "$0")}
if ((BASH_VERSINFO[0] < 4 || (BASH_VERSINFO[0] == 4 && BASH_VERSINFO[1] < 4))); then
  printf '%s: error: needs bash >= 4.4 (this is %s); on macOS: brew install bash\n' "$PROG" "$BASH_VERSION" >&2
  exit 2
fi
# fd 3 = the script's stdout, so dry-run lines printed inside $(...) still reach it.
exec 3>&1

# q WORD: WORD quoted for a POSIX shell, left bare when it holds only safe characters.
q() {
  local s=$1
  if [[ -n $s && $s =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$s"
  elif [[ $s == *"'"* && $s != *[\"\$\`\\!]* ]]; then
    printf '"%s"' "$s"  # has single quotes but nothing special inside double quotes
  else
    printf "'%s'" "${s//"'"/"'\\''"}"
  fi
}

# join_quoted WORD...: the words quoted and joined by spaces (one shell command line).
join_quoted() {
  local out="" w
  for w in "$@"; do out+="${out:+ }$(q "$w")"; done
  printf '%s' "$out"
}

# shell_command WORD...: the user's command as one shell string for a remote shell.
# One word is taken as a shell string as it is (pipes, redirections and $VARS work remotely);
# several words are quoted one by one, so the remote program gets exactly this argv.
shell_command() {
  if (($# == 1)); then printf '%s' "$1"; else join_quoted "$@"; fi
}

run() {
  local line
  line="+ $(join_quoted "$@")"
  if ((DRY_RUN)); then
    printf '%s\n' "$line" >&3
  else
    printf '%s\n' "$line" >&2
    "$@"
  fi
}

note() {
  if ((DRY_RUN)); then printf '# %s\n' "$*" >&3; else printf '# %s\n' "$*" >&2; fi
}

# die MESSAGE: a usage error (exit 2).
die() {
  printf '%s: error: %s\n' "$PROG" "$*" >&2
  printf "Run '%s --help' for usage.\n" "$PROG" >&2
  exit 2
}

# fail MESSAGE: a run-time failure (exit 1).
fail() {
  printf '%s: %s\n' "$PROG" "$*" >&2
  exit 1
}

# Option parsing helpers. The scripts accept "--flag VALUE" and "--flag=VALUE".
# need_value FLAG INLINE [REST...]: REST[0] must be a value (not another --flag, unless inline).
need_value() {
  local flag=$1 inline=$2
  shift 2
  if (($# == 0)); then die "$flag needs a value"; fi
  if [[ $inline == 0 && $1 == --* ]]; then die "$flag needs a value (got '$1')"; fi
  if [[ -z $1 ]]; then die "$flag needs a non-empty value"; fi
}

no_value() {
  [[ $2 == 0 ]] || die "$1 takes no value"
}

# normalize_tpu TYPE: user-facing names -> gcloud/xpk accelerator types (v5e-8 -> v5litepod-8).
normalize_tpu() {
  local t=${1,,}
  case $t in
    v5e-*) t=v5litepod-${t#v5e-} ;;
    v5lite-*) t=v5litepod-${t#v5lite-} ;;
    v6-*) t=v6e-${t#v6-} ;;
  esac
  printf '%s' "$t"
}

TPU_TYPE_RE='^(v2|v3|v4|v5p|v5litepod|v6e)-[1-9][0-9]*$'

check_tpu_type() {
  local flag=$1 t=$2
  [[ $t =~ $TPU_TYPE_RE ]] || die "$flag: unknown TPU type '$t'; expected FAMILY-SIZE with FAMILY one of v2, v3, v4, v5p, v5litepod (alias v5e), v6e, e.g. v5litepod-8, v6e-8, v5p-8, v4-8"
}

check_env_assignment() {
  local kv=$1
  [[ $kv == *=* ]] || die "--env expects KEY=VALUE; got '$kv'"
  [[ ${kv%%=*} =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "--env: '${kv%%=*}' is not a valid environment variable name"
}

# --serve: `dgemma serve` on the one host of a single-host slice, listening on every interface.
SINGLE_HOST_TPUS="v5litepod-1 v5litepod-4 v5litepod-8 v6e-1 v6e-4 v6e-8 v5p-8 v4-8"
check_serve() {  # check_serve TPU_TYPE PORT
  [[ " $SINGLE_HOST_TPUS " == *" $1 "* ]] \
    || die "--serve runs the server on one host; '$1' is a multi-host slice. Choose one of: $SINGLE_HOST_TPUS"
  [[ $2 =~ ^[1-9][0-9]{0,4}$ ]] && (($2 <= 65535)) || die "--port must be a TCP port (1-65535); got '$2'"
}
# The server listens beyond loopback, so it takes an API key (`dgemma serve` reads DGEMMA_API_KEY): the
# one given (--api-key in its options, --env DGEMMA_API_KEY=..., or DGEMMA_API_KEY in this script's
# environment), else a new random one, printed once (serve_note, after the checks). It goes to the host
# as an --env variable (ENVS).
SERVE_NOTE=""
serve_note() { [[ -z $SERVE_NOTE ]] || note "$SERVE_NOTE"; }
serve_command() {  # serve_command PORT [dgemma serve options...] -> SERVE_CMD array (and ENVS)
  local port=$1 a kv
  shift
  SERVE_CMD=(dgemma serve --host 0.0.0.0 --port "$port" "$@")
  for a in "$@"; do [[ $a != --api-key && $a != --api-key=* ]] || return 0; done
  for kv in "${ENVS[@]}"; do [[ $kv != DGEMMA_API_KEY=* ]] || return 0; done
  if [[ -n ${DGEMMA_API_KEY:-} ]]; then
    ENVS+=("DGEMMA_API_KEY=$DGEMMA_API_KEY")
    SERVE_NOTE="the server takes the API key in \$DGEMMA_API_KEY (clients: Authorization: Bearer <key>)"
  else
    local key
    key="dg-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
    ENVS+=("DGEMMA_API_KEY=$key")
    SERVE_NOTE="the server listens on every interface, so it requires an API key: $key (clients send Authorization: Bearer $key; set DGEMMA_API_KEY to choose it)"
  fi
}

# host_command DIR VENV CMD...: the shell string each host runs, in a real launch and in --simulate alike:
#   cd DIR && . VENV/bin/activate && export KEY=VALUE (one per --env, from ENVS) && COMMAND
# DIR and VENV go in as they are (a remote '~' expands on the host; quote local paths with q); an empty
# VENV leaves the activation out.
host_command() {
  local dir=$1 venv=$2 kv s
  shift 2
  s="cd $dir"
  [[ -z $venv ]] || s+=" && . $venv/bin/activate"
  for kv in "${ENVS[@]}"; do s+=" && export ${kv%%=*}=$(q "${kv#*=}")"; done
  printf '%s && %s' "$s" "$(shell_command "$@")"
}

# ------------------------------------------------------------------ --simulate HOSTS: a pod on this machine
# The per-host command runs as HOSTS local processes joined by jax.distributed (gloo collectives on
# CPU), each with SIM_DEVICES fake CPU devices: host i gets DGEMMA_COORDINATOR=127.0.0.1:PORT,
# DGEMMA_NUM_PROCESSES=HOSTS and DGEMMA_PROCESS_ID=i, which `dgemma` reads at start. Host 0 has this
# script's stdin, stdout and stderr; host i > 0 reads /dev/null and writes $DGEMMA_SIM_LOGS/host-<i>.out
# and .err. Each host runs in its own process group; $DGEMMA_SIM_LOGS/host-<i>.pid holds its leader's
# pid (= the group id). When a host exits non-zero or is killed, the others are stopped (SIGTERM, then
# SIGKILL after 10 s) and the script exits with that host's status, as a JobSet restarts the whole slice.
SIM_HOSTS="" SIM_DEVICES=4
check_simulate() {
  [[ $SIM_HOSTS =~ ^[1-9][0-9]{0,2}$ ]] || die "--simulate takes a number of hosts (1-999); got '$SIM_HOSTS'"
  [[ $SIM_DEVICES =~ ^[1-9][0-9]{0,3}$ ]] || die "--simulate-devices takes a number of CPU devices per host; got '$SIM_DEVICES'"
}

free_port() {  # a free TCP port on 127.0.0.1 (python3 asks the kernel; without python3, a random one)
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null \
    || printf '%s' $((20000 + RANDOM % 40000))
}

SIM_PIDS=() SIM_TTY_PID=""
sim_signal() {  # sim_signal SIG: signal every host's process group (host 0 on a terminal: it and its children)
  local pid
  for pid in "${SIM_PIDS[@]}"; do
    if [[ $pid == "$SIM_TTY_PID" ]]; then
      pkill "-$1" -P "$pid" 2>/dev/null || true
      kill "-$1" "$pid" 2>/dev/null || true
    else
      kill "-$1" -- "-$pid" 2>/dev/null || true
    fi
  done
}
sim_alive() {
  local pid
  for pid in "${SIM_PIDS[@]}"; do
    if kill -0 -- "-$pid" 2>/dev/null || { [[ $pid == "$SIM_TTY_PID" ]] && kill -0 "$pid" 2>/dev/null; }; then
      return 0
    fi
  done
  return 1
}
sim_stop() {  # SIGTERM every host, SIGKILL what is left after 10 s
  local t
  sim_signal TERM
  for ((t = 0; t < 100; t++)); do
    sim_alive || return 0
    sleep 0.1
  done
  sim_signal KILL
}

simulate() {  # simulate SHELL_STRING: run the per-host command as SIM_HOSTS local processes
  local s=$1 logs port i pid st rc=0 left who
  local -a argv
  port=$(free_port)
  if ((DRY_RUN)); then
    logs=${DGEMMA_SIM_LOGS:-'$DGEMMA_SIM_LOGS'}
  elif [[ -n ${DGEMMA_SIM_LOGS:-} ]]; then
    logs=$DGEMMA_SIM_LOGS
    mkdir -p "$logs"
  else
    logs=$(mktemp -d "${TMPDIR:-/tmp}/dgemma-sim.XXXXXX")
  fi
  note "simulated pod: $SIM_HOSTS host(s) x $SIM_DEVICES CPU device(s), jax.distributed through 127.0.0.1:$port"
  note "host 0 has this script's stdin, stdout and stderr; host i > 0 writes $logs/host-<i>.out and .err; pids in $logs/host-<i>.pid"
  ((DRY_RUN)) || trap 'sim_stop; exit 130' INT
  ((DRY_RUN)) || trap 'sim_stop; exit 143' TERM
  set -m  # each host in its own process group, so that stopping it stops everything it started
  for ((i = 0; i < SIM_HOSTS; i++)); do
    argv=(env "XLA_FLAGS=--xla_force_host_platform_device_count=$SIM_DEVICES" JAX_PLATFORMS=cpu
          "DGEMMA_COORDINATOR=127.0.0.1:$port" "DGEMMA_NUM_PROCESSES=$SIM_HOSTS" "DGEMMA_PROCESS_ID=$i"
          bash -c "$s")
    if ((DRY_RUN)); then
      run "${argv[@]}"
      continue
    fi
    printf '+ %s\n' "$(join_quoted "${argv[@]}")" >&2
    if ((i == 0)) && [[ -t 0 ]]; then
      set +m  # reading a terminal from a background process group would stop it (SIGTTIN): stay in ours
      "${argv[@]}" <&0 &
      SIM_TTY_PID=$!
      set -m
    elif ((i == 0)); then
      "${argv[@]}" <&0 &
    else
      : >"$logs/host-$i.out"
      : >"$logs/host-$i.err"
      "${argv[@]}" </dev/null >"$logs/host-$i.out" 2>"$logs/host-$i.err" &
    fi
    pid=$!
    SIM_PIDS+=("$pid")
    printf '%s\n' "$pid" >"$logs/host-$i.pid"
  done
  set +m
  ((DRY_RUN == 0)) || return 0
  for ((left = SIM_HOSTS; left > 0; left--)); do
    st=0 pid=""
    if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= 501)); then wait -n -p pid || st=$?; else wait -n || st=$?; fi
    if ((st != 0)); then
      who="a host"
      for ((i = 0; i < SIM_HOSTS; i++)); do [[ ${SIM_PIDS[i]} != "$pid" ]] || who="host $i"; done
      note "$who exited with status $st: stopping the other hosts (their logs are in $logs)"
      rc=$st
      sim_stop
      break
    fi
  done
  wait || true
  trap - INT TERM
  return "$rc"
}
