#!/usr/bin/env bash
# Run a dgemma_jax command on every worker of a Cloud TPU VM (single host or a multi-host slice).
# See launch/README.md and `launch/tpu_vm.sh --help`.
set -euo pipefail

PROG=tpu_vm.sh
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/_lib.sh
source "$HERE/_lib.sh"

usage() {
  cat <<'EOF'
Usage: launch/tpu_vm.sh --name NAME --zone ZONE [options] -- COMMAND [ARGS...]

Create (or reuse) a Cloud TPU VM, copy this project to every worker, install it with
`pip install -e ".[tpu]"` into a Python 3.11 virtualenv, and run COMMAND on all workers at once
(`gcloud compute tpus tpu-vm ssh --worker=all`). On a multi-host slice every worker runs the same
command; jax.distributed.initialize() finds its peers from the TPU metadata by itself.

Required:
  --name NAME            TPU VM name (lowercase letters, digits, '-'; starts with a letter)
  --zone ZONE            zone, e.g. us-east5-b, europe-west4-a, us-central2-b

Resource:
  --accelerator TYPE     TPU type (default v5litepod-8): v5litepod-8 (alias v5e-8), v6e-8, v5p-8,
                         v4-8, or bigger slices such as v5litepod-16, v6e-32, v5p-32, v4-32
  --version RUNTIME      TPU software version (default by family: v6e v2-alpha-tpuv6e,
                         v5litepod v2-alpha-tpuv5-lite, v5p v2-alpha-tpuv5, v4 and older
                         tpu-ubuntu2204-base)
  --project PROJECT      Google Cloud project (default: gcloud's configured project)
  --spot                 ask for Spot capacity (cheaper, can be preempted)
  --queued               request the TPU through a queued resource and wait until it is ACTIVE
  --wait-timeout SECS    how long to wait for a queued resource (default 3600)
  --reuse                use an existing TPU VM NAME (checked with `describe`) instead of creating
                         one; an error if it does not exist
  --delete-after         delete the TPU VM (or the queued resource) after COMMAND, even if it fails

Code and install:
  --source-dir DIR       local project to copy (default: this checkout); packed with tar and copied
                         with `gcloud compute tpus tpu-vm scp --worker=all`
  --exclude PATTERN      also leave PATTERN out of the copy (repeatable; .git, venvs, caches and
                         build outputs are always left out)
  --git-url URL          clone URL on every worker instead of copying the local tree
  --git-ref REF          branch, tag or commit to check out after cloning (implies --git-url, whose
                         default is this checkout's `origin`)
  --remote-dir DIR       project directory on the workers (default ~/dgemma_jax)
  --venv DIR             virtualenv on the workers (default ~/dgemma-venv)
  --python VERSION       Python for the virtualenv, installed by uv if missing (default 3.11)
  --pip PACKAGE          one more package to install next to ".[tpu]" (repeatable)
  --skip-copy            do not copy or clone the code (it is already on the workers)
  --skip-install         do not install (already installed)
  --setup-only           create, copy and install; no COMMAND needed

Running:
  --serve                serve mode: run `dgemma serve --host 0.0.0.0 --port PORT ARGS...` on the VM
                         (single-host slices only: v5litepod-8, v6e-8, v5p-8, v4-8, ...), with the
                         words after `--` as the server's options (none: the bundled model), and
                         forward PORT to localhost through the SSH session while it runs
  --port PORT            serve mode: the server's port, also forwarded to localhost (default 8000)
  --env KEY=VALUE        export KEY=VALUE before COMMAND on the workers (repeatable)
  --iap                  reach the workers through IAP (--tunnel-through-iap)
  --simulate HOSTS       no TPU, no gcloud: run the per-host command (the one `ssh --worker=all` runs)
                         as HOSTS processes on this machine, this checkout as it is, joined by
                         jax.distributed over 127.0.0.1 with --simulate-devices CPU devices each.
                         --name/--zone are optional; the venv is --venv or $VIRTUAL_ENV (or none).
                         Host 0 has this terminal; host i > 0 writes $DGEMMA_SIM_LOGS/host-<i>.out
                         and .err (default: a new temporary directory); host-<i>.pid holds each
                         host's pid (its process group). A host that fails stops the others; the
                         exit status is 0 only if every host exits 0
  --simulate-devices N   CPU devices per simulated host (default 4)
  --dry-run              print every command, one per line as "+ CMD", and run nothing
  -h, --help             this help

COMMAND: everything after `--`. Several words are quoted one by one, so the remote program gets
exactly that argv. A single word is used as a shell string as it is, so pipes, redirections and
$VARIABLES are evaluated on the workers: -- 'dgemma generate --prompt hi | tee out.txt'.

Examples:
  # a v5e-8 (8 chips, one host): create, copy, install, generate
  launch/tpu_vm.sh --name dg-v5e --zone us-east5-b --accelerator v5litepod-8 \
      -- dgemma generate --checkpoint gs://my-bucket/diffusiongemma --prompt "Hello there"

  # a Spot v6e-8 through a queued resource, deleted afterwards
  launch/tpu_vm.sh --name dg-v6e --zone us-east5-b --accelerator v6e-8 --spot --queued \
      --delete-after -- dgemma generate --checkpoint /data/ckpt --prompt "hi"

  # rerun on an existing VM without copying or reinstalling
  # serve the 26B on a v6e-8: an OpenAI-compatible server, reachable at http://localhost:8000/v1
  launch/tpu_vm.sh --name dg-v6e --zone us-east5-b --accelerator v6e-8 --serve \
      -- --checkpoint gs://my-bucket/diffusiongemma --mesh data=2,expert=4 --rules throughput --slots 32 --context 4096

  launch/tpu_vm.sh --name dg-v5e --zone us-east5-b --reuse --skip-copy --skip-install \
      -- python -c "import jax; print(jax.device_count())"

  # see what would run
  launch/tpu_vm.sh --dry-run --name dg-v5p --zone us-east5-a --accelerator v5p-8 -- dgemma --help

  # a 2-host pod simulated on this machine (2 processes x 4 CPU devices), no TPU needed
  launch/tpu_vm.sh --simulate 2 -- dgemma generate --mesh data=2,expert=4 --prompt s9350814272=
EOF
}

NAME="" ZONE="" ACCEL="v5litepod-8" VERSION="" PROJECT=""
SPOT=0 QUEUED=0 REUSE=0 DELETE_AFTER=0 WAIT_TIMEOUT=3600 POLL_SECONDS=${DGEMMA_POLL_SECONDS:-30}
SOURCE_DIR=$(cd "$HERE/.." && pwd) GIT_URL="" GIT_REF="" USE_GIT=0
# shellcheck disable=SC2088  # '~' is expanded by the workers' shell, not here
REMOTE_DIR="~/dgemma_jax" VENV="~/dgemma-venv" PYVER="3.11"
SKIP_COPY=0 SKIP_INSTALL=0 SETUP_ONLY=0 IAP=0 HAVE_CMD=0 SERVE=0 PORT=8000 VENV_SET=0
EXCLUDES=() PIP_EXTRA=() ENVS=() CMD=()

(($# > 0)) || { usage >&2; exit 2; }
while (($#)); do
  arg=$1
  shift
  inline=0
  case $arg in
    --) HAVE_CMD=1; CMD=("$@"); break ;;
    --*=*) set -- "${arg#*=}" "$@"; arg=${arg%%=*}; inline=1 ;;
  esac
  case $arg in
    -h|--help) usage; exit 0 ;;
    --dry-run) no_value "$arg" $inline; DRY_RUN=1 ;;
    --name) need_value "$arg" $inline "$@"; NAME=$1; shift ;;
    --zone) need_value "$arg" $inline "$@"; ZONE=$1; shift ;;
    --accelerator|--accelerator-type|--tpu-type) need_value "$arg" $inline "$@"; ACCEL=$1; shift ;;
    --version|--runtime-version) need_value "$arg" $inline "$@"; VERSION=$1; shift ;;
    --project) need_value "$arg" $inline "$@"; PROJECT=$1; shift ;;
    --spot) no_value "$arg" $inline; SPOT=1 ;;
    --queued) no_value "$arg" $inline; QUEUED=1 ;;
    --wait-timeout) need_value "$arg" $inline "$@"; WAIT_TIMEOUT=$1; shift ;;
    --reuse) no_value "$arg" $inline; REUSE=1 ;;
    --delete-after) no_value "$arg" $inline; DELETE_AFTER=1 ;;
    --source-dir) need_value "$arg" $inline "$@"; SOURCE_DIR=$1; shift ;;
    --exclude) need_value "$arg" $inline "$@"; EXCLUDES+=("$1"); shift ;;
    --git-url) need_value "$arg" $inline "$@"; GIT_URL=$1; USE_GIT=1; shift ;;
    --git-ref) need_value "$arg" $inline "$@"; GIT_REF=$1; USE_GIT=1; shift ;;
    --remote-dir) need_value "$arg" $inline "$@"; REMOTE_DIR=$1; shift ;;
    --venv) need_value "$arg" $inline "$@"; VENV=$1; VENV_SET=1; shift ;;
    --python) need_value "$arg" $inline "$@"; PYVER=$1; shift ;;
    --pip) need_value "$arg" $inline "$@"; PIP_EXTRA+=("$1"); shift ;;
    --skip-copy) no_value "$arg" $inline; SKIP_COPY=1 ;;
    --skip-install) no_value "$arg" $inline; SKIP_INSTALL=1 ;;
    --setup-only) no_value "$arg" $inline; SETUP_ONLY=1 ;;
    --env) need_value "$arg" $inline "$@"; check_env_assignment "$1"; ENVS+=("$1"); shift ;;
    --iap) no_value "$arg" $inline; IAP=1 ;;
    --serve) no_value "$arg" $inline; SERVE=1 ;;
    --port) need_value "$arg" $inline "$@"; PORT=$1; shift ;;
    --simulate) need_value "$arg" $inline "$@"; SIM_HOSTS=$1; shift ;;
    --simulate-devices) need_value "$arg" $inline "$@"; SIM_DEVICES=$1; shift ;;
    -*) die "unknown option '$arg'" ;;
    *) die "unexpected argument '$arg'; put the command to run after '--'" ;;
  esac
done

# ------------------------------------------------------------------ validation
SIMULATE=0
if [[ -n $SIM_HOSTS ]]; then
  check_simulate
  SIMULATE=1
  ((SETUP_ONLY == 0)) || die "--simulate runs the command on this machine; --setup-only has nothing to do there"
fi
((SIMULATE)) || [[ -n $NAME ]] || die "--name is required"
((SIMULATE)) || [[ -n $ZONE ]] || die "--zone is required"
[[ -z $NAME || $NAME =~ ^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$ ]] \
  || die "--name '$NAME' is not a valid TPU name (lowercase letters, digits and '-', starting with a letter, at most 63 characters)"
[[ -z $ZONE || $ZONE =~ ^[a-z]+-[a-z]+[0-9]+-[a-z]$ ]] || die "--zone '$ZONE' does not look like a zone (e.g. us-east5-b)"
if [[ -n $PROJECT && ! $PROJECT =~ ^[a-z][-a-z0-9.:]*[a-z0-9]$ ]]; then
  die "--project '$PROJECT' is not a valid project id"
fi
ACCEL=$(normalize_tpu "$ACCEL")
check_tpu_type --accelerator "$ACCEL"
if [[ -z $VERSION ]]; then
  case $ACCEL in
    v6e-*) VERSION=v2-alpha-tpuv6e ;;
    v5litepod-*) VERSION=v2-alpha-tpuv5-lite ;;
    v5p-*) VERSION=v2-alpha-tpuv5 ;;
    *) VERSION=tpu-ubuntu2204-base ;;
  esac
fi
[[ $VERSION =~ ^[a-z0-9][-a-z0-9.]*$ ]] || die "--version '$VERSION' is not a valid TPU runtime version"
[[ $WAIT_TIMEOUT =~ ^[1-9][0-9]*$ ]] || die "--wait-timeout must be a positive number of seconds; got '$WAIT_TIMEOUT'"
[[ $PYVER =~ ^3\.[0-9]+$ ]] || die "--python must look like 3.11; got '$PYVER'"
for p in "$REMOTE_DIR" "$VENV"; do
  [[ $p =~ ^[~A-Za-z0-9_./-]+$ ]] || die "remote path '$p' may only hold letters, digits and ~ _ . / -"
done
for p in "${PIP_EXTRA[@]}"; do
  [[ $p != -* ]] || die "--pip takes a package requirement, not a pip option ('$p')"
done
if ((REUSE)); then
  ((QUEUED == 0)) || die "--reuse and --queued do not go together (--queued creates a new TPU)"
  ((SPOT == 0)) || die "--reuse and --spot do not go together (--spot applies when creating a TPU)"
fi
if ((SERVE)); then
  ((SETUP_ONLY == 0)) || die "--serve and --setup-only do not go together"
  check_serve "$ACCEL" "$PORT"
  ((SIMULATE == 0 || SIM_HOSTS == 1)) \
    || die "--serve runs the server on one host (one host per replica); simulate that with --simulate 1"
  serve_command "$PORT" "${CMD[@]}"
  CMD=("${SERVE_CMD[@]}")
elif ((HAVE_CMD == 0 || ${#CMD[@]} == 0)); then
  ((SETUP_ONLY)) || die "no command given; put the command to run on the workers after '--' (or pass --setup-only)"
elif ((SETUP_ONLY)); then
  die "--setup-only runs no command; drop the command after '--' or drop --setup-only"
fi
if ((USE_GIT && SKIP_COPY)); then die "--git-url/--git-ref and --skip-copy contradict each other"; fi
if ((USE_GIT && !SIMULATE)) && [[ -z $GIT_URL ]]; then
  GIT_URL=$(git -C "$SOURCE_DIR" remote get-url origin 2>/dev/null) \
    || die "--git-ref needs --git-url (this checkout has no 'origin' remote)"
fi
if ((!USE_GIT && !SKIP_COPY)); then
  [[ -d $SOURCE_DIR && -f $SOURCE_DIR/setup.py ]] || die "--source-dir '$SOURCE_DIR' is not a dgemma_jax checkout (no setup.py)"
fi

serve_note
# ------------------------------------------------------------------ commands
LOC=(--zone="$ZONE")
[[ -z $PROJECT ]] || LOC+=(--project="$PROJECT")
SSH_EXTRA=()
((IAP == 0)) || SSH_EXTRA+=(--tunnel-through-iap)
TPUVM=(gcloud compute tpus tpu-vm)
QR=(gcloud compute tpus queued-resources)

on_all_workers() {  # on_all_workers SHELL_STRING
  run "${TPUVM[@]}" ssh "$NAME" "${LOC[@]}" --worker=all "${SSH_EXTRA[@]}" --command "$1"
}

provision() {
  if ((REUSE)); then
    note "reusing the existing TPU VM $NAME in $ZONE"
    local state
    if ! state=$(run "${TPUVM[@]}" describe "$NAME" "${LOC[@]}" --format="value(state)"); then
      fail "TPU VM '$NAME' was not found in $ZONE${PROJECT:+ (project $PROJECT)}; drop --reuse to create it"
    fi
    if ((!DRY_RUN)) && [[ $state != READY ]]; then
      note "warning: TPU VM $NAME is in state '$state', not READY"
    fi
    DELETE_ARMED=$DELETE_AFTER
    return
  fi
  local spot=()
  ((SPOT == 0)) || spot=(--spot)
  if ((QUEUED)); then
    note "requesting $ACCEL ($VERSION) through queued resource $NAME"
    run "${QR[@]}" create "$NAME" --node-id="$NAME" "${LOC[@]}" --accelerator-type="$ACCEL" \
      --runtime-version="$VERSION" "${spot[@]}"
    DELETE_ARMED=$DELETE_AFTER
    wait_active
  else
    note "creating TPU VM $NAME: $ACCEL ($VERSION) in $ZONE"
    run "${TPUVM[@]}" create "$NAME" "${LOC[@]}" --accelerator-type="$ACCEL" --version="$VERSION" "${spot[@]}"
    DELETE_ARMED=$DELETE_AFTER
  fi
}

wait_active() {
  local describe=("${QR[@]}" describe "$NAME" "${LOC[@]}" --format="value(state.state)")
  if ((DRY_RUN)); then
    note "poll every ${POLL_SECONDS}s (up to ${WAIT_TIMEOUT}s) until the state is ACTIVE:"
    run "${describe[@]}"
    return
  fi
  local deadline=$((SECONDS + WAIT_TIMEOUT)) state
  while :; do
    state=$(run "${describe[@]}") || fail "could not read the state of queued resource $NAME"
    case $state in
      ACTIVE) note "queued resource $NAME is ACTIVE"; return ;;
      FAILED|SUSPENDED|SUSPENDING) fail "queued resource $NAME is $state; see: ${QR[*]} describe $NAME --zone=$ZONE" ;;
    esac
    ((SECONDS < deadline)) || fail "queued resource $NAME still '$state' after ${WAIT_TIMEOUT}s; it stays queued (delete it with: ${QR[*]} delete $NAME --zone=$ZONE --force)"
    note "queued resource $NAME is '$state'; waiting ${POLL_SECONDS}s"
    sleep "$POLL_SECONDS"
  done
}

copy_code() {
  if ((USE_GIT)); then
    note "cloning $GIT_URL${GIT_REF:+ at $GIT_REF} into $REMOTE_DIR on every worker"
    local s
    s="rm -rf $REMOTE_DIR && git clone --quiet $(q "$GIT_URL") $REMOTE_DIR"
    [[ -z $GIT_REF ]] || s+=" && git -C $REMOTE_DIR checkout --quiet $(q "$GIT_REF")"
    on_all_workers "$s"
    return
  fi
  local tarball="${TMPDIR:-/tmp}/dgemma_jax-$NAME.tgz" ex=()
  local pat
  for pat in .git .venv venv '*.egg-info' __pycache__ .pytest_cache .ipynb_checkpoints build dist "${EXCLUDES[@]}"; do
    ex+=(--exclude="$pat")
  done
  note "copying $SOURCE_DIR to $REMOTE_DIR on every worker"
  ((DRY_RUN)) || TARBALL=$tarball
  run tar -czf "$tarball" "${ex[@]}" -C "$SOURCE_DIR" .
  run "${TPUVM[@]}" scp "$tarball" "$NAME:dgemma_jax-src.tgz" "${LOC[@]}" --worker=all "${SSH_EXTRA[@]}"
  on_all_workers "rm -rf $REMOTE_DIR && mkdir -p $REMOTE_DIR && tar -xzf dgemma_jax-src.tgz -C $REMOTE_DIR && rm -f dgemma_jax-src.tgz"
}

install() {
  note "installing dgemma_jax[tpu] into $VENV (Python $PYVER via uv) on every worker"
  local extra="" p
  for p in "${PIP_EXTRA[@]}"; do extra+=" $(q "$p")"; done
  on_all_workers "export PATH=\"\$HOME/.local/bin:\$HOME/.cargo/bin:\$PATH\" && \
(command -v uv >/dev/null 2>&1 || curl -LsSf https://astral.sh/uv/install.sh | sh) && \
(test -x $VENV/bin/python || uv venv --seed --python $PYVER $VENV) && \
cd $REMOTE_DIR && uv pip install --python $VENV/bin/python -e '.[tpu]'$extra && \
$VENV/bin/python -c 'import dgemma_jax, jax; print(\"dgemma_jax\", dgemma_jax.__version__, \"jax\", jax.__version__)'"
}

run_command() {
  local s
  s=$(host_command "$REMOTE_DIR" "$VENV" "${CMD[@]}")
  if ((SERVE)); then
    note "serving on $NAME: $(shell_command "${CMD[@]}")"
    note "while this runs: http://localhost:$PORT/v1 (forwarded through SSH); Ctrl-C or SIGTERM drains and stops it"
    run "${TPUVM[@]}" ssh "$NAME" "${LOC[@]}" --worker=0 "${SSH_EXTRA[@]}" --command "$s" \
      -- -L "$PORT:localhost:$PORT"
    return
  fi
  note "running on all workers of $NAME: $(shell_command "${CMD[@]}")"
  on_all_workers "$s"
}

delete_tpu() {
  if ((QUEUED)); then
    note "deleting queued resource $NAME and its TPU VM"
    run "${QR[@]}" delete "$NAME" "${LOC[@]}" --force --quiet
  else
    note "deleting TPU VM $NAME"
    run "${TPUVM[@]}" delete "$NAME" "${LOC[@]}" --quiet
  fi
}

# --simulate: the per-host command of run_command, on this machine, in this checkout.
if ((SIMULATE)); then
  ((DRY_RUN == 0)) || note "dry run: nothing below is executed"
  note "simulating $SIM_HOSTS host(s) here instead of a TPU: no gcloud, no copy, no install; this checkout as it is"
  sim_venv=${VIRTUAL_ENV:-}
  ((VENV_SET == 0)) || sim_venv=$VENV
  [[ -z $sim_venv ]] || sim_venv=$(q "$sim_venv")
  ((SERVE == 0)) || note "serving on host 0: http://localhost:$PORT/v1 while this runs"
  rc=0
  simulate "$(host_command "$(q "$SOURCE_DIR")" "$sim_venv" "${CMD[@]}")" || rc=$?
  exit "$rc"
fi

# In a real run, an EXIT trap removes the local tarball and, with --delete-after, deletes the TPU
# once this script created (or reused) it, whatever fails after that point.
TARBALL="" DELETE_ARMED=0
cleanup() {
  local rc=$?
  trap - EXIT
  [[ -z $TARBALL ]] || rm -f "$TARBALL"
  if ((DELETE_ARMED)); then delete_tpu || rc=1; fi
  exit "$rc"
}
if ((DRY_RUN)); then
  note "dry run: nothing below is executed"
else
  trap cleanup EXIT
fi
provision
((SKIP_COPY)) || copy_code
((SKIP_INSTALL)) || install
((SETUP_ONLY)) || run_command
if ((DRY_RUN && DELETE_AFTER)); then delete_tpu; fi
