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
serve_command() {  # serve_command PORT [dgemma serve options...] -> SERVE_CMD array
  local port=$1
  shift
  SERVE_CMD=(dgemma serve --host 0.0.0.0 --port "$port" "$@")
}
