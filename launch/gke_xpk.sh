#!/usr/bin/env bash
# Run a dgemma_jax command as a TPU workload on GKE, through XPK or as a plain JobSet YAML.
# See launch/README.md and `launch/gke_xpk.sh --help`.
set -euo pipefail

PROG=gke_xpk.sh
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/_lib.sh
source "$HERE/_lib.sh"

usage() {
  cat <<'EOF'
Usage: launch/gke_xpk.sh --cluster CLUSTER [options] -- COMMAND [ARGS...]
       launch/gke_xpk.sh --emit-yaml FILE|- [options] -- COMMAND [ARGS...]

Submit COMMAND as an XPK workload on a GKE cluster with TPU node pools (`xpk workload create`).
Every host of every slice runs COMMAND; jax.distributed.initialize() finds its peers, and XPK sets
the MEGASCALE_* variables that join several slices. By default XPK builds an image from
--base-docker-image with this checkout copied to /app, and COMMAND is preceded by
`pip install -e ".[tpu]"`. With --docker-image, the image is used as it is (dgemma_jax installed).

With --emit-yaml, nothing is submitted: the script writes a JobSet manifest for the same workload
(for clusters without XPK; apply it with `kubectl apply -f FILE`, the JobSet controller must be
installed). The manifest needs --docker-image (dgemma_jax installed) or --git-url (cloned and
installed when the pod starts).

Options:
  --cluster NAME         GKE cluster (required unless --emit-yaml)
  --workload NAME        workload / JobSet name (default dgemma-YYYYMMDD-HHMMSS; lowercase letters,
                         digits and '-', at most 40 characters)
  --tpu-type TYPE        TPU slice type (default v5litepod-8): v5litepod-8 (alias v5e-8), v6e-8,
                         v5p-8, v4-8, v5litepod-16, v6e-256, ...
  --num-slices N         number of slices (default 1)
  --zone ZONE            cluster location passed to xpk (default: xpk's/gcloud's default)
  --project PROJECT      Google Cloud project (default: gcloud's configured project)
  --docker-image IMAGE   a ready image with dgemma_jax[tpu] installed (no install step)
  --base-docker-image IMAGE
                         base image XPK adds --script-dir to (default python:3.11)
  --script-dir DIR       directory XPK copies into the image (default: this checkout)
  --skip-install         do not run `pip install -e ".[tpu]"` before COMMAND
  --priority P           very-low | low | medium | high | very-high
  --max-restarts N       JobSet restarts on failure (default 0)
  --spot                 run on Spot capacity (xpk --spot; YAML: gke-spot node selector)
  --env KEY=VALUE        environment variable for the containers (repeatable)
  --wait                 after submitting, wait for the workload to finish
                         (`xpk workload list --wait-for-job-completion`)
  --xpk PROGRAM          how to call xpk (default "xpk"; e.g. "python3 /path/to/xpk.py")
  --emit-yaml FILE       write a JobSet manifest to FILE ('-' for stdout) instead of calling xpk
  --topology TOPO        TPU topology for --emit-yaml when the type is not in the built-in table
  --git-url URL          --emit-yaml: clone URL for containers without dgemma_jax installed
  --git-ref REF          --emit-yaml: branch, tag or commit to check out
  --serve                serve mode: the container runs `dgemma serve --host 0.0.0.0 --port PORT
                         ARGS...` with the words after `--` as the server's options (single-host
                         slices, one slice per replica); --emit-yaml adds a ClusterIP Service on
                         PORT and a readiness probe on /health
  --port PORT            serve mode: the server's port (default 8000)
  --replicas N           serve mode with --emit-yaml: N independent single-host servers (the
                         JobSet's replicas) behind the one Service, which spreads the connections
                         over the ready ones (default 1)
  --simulate HOSTS       no cluster: run the per-host command (COMMAND in this checkout, without
                         the install step) as HOSTS processes on this machine, joined by
                         jax.distributed over 127.0.0.1 with --simulate-devices CPU devices each;
                         see `launch/tpu_vm.sh --help` for the logs, pids and exit status
  --simulate-devices N   CPU devices per simulated host (default 4)
  --dry-run              print every command, one per line as "+ CMD", and run nothing
  -h, --help             this help

COMMAND: everything after `--`. Several words are quoted one by one (the container gets exactly
that argv); a single word is used as a shell string as it is.

Examples:
  launch/gke_xpk.sh --cluster my-v6e --tpu-type v6e-8 --zone us-east5-b \
      -- dgemma generate --checkpoint gs://my-bucket/diffusiongemma --prompt "Hello"
  launch/gke_xpk.sh --cluster my-v5e --tpu-type v5litepod-16 --num-slices 2 --spot \
      --docker-image us-docker.pkg.dev/my-proj/dgemma/dgemma:latest -- dgemma bench
  launch/gke_xpk.sh --emit-yaml job.yaml --workload dg-run --tpu-type v5p-8 \
      --git-url https://github.com/me/dgemma_jax --git-ref main -- dgemma generate --prompt hi
  kubectl apply -f job.yaml
  # 4 servers, one v6e-8 each, behind one Service; then: kubectl apply -f serve.yaml
  launch/gke_xpk.sh --emit-yaml serve.yaml --workload dg-serve --tpu-type v6e-8 --docker-image IMAGE \
      --serve --replicas 4 -- --checkpoint gs://my-bucket/diffusiongemma --mesh expert=8
  # the per-host command on a 2-host pod simulated here (2 processes x 4 CPU devices)
  launch/gke_xpk.sh --simulate 2 -- dgemma generate --mesh data=2,expert=4 --prompt s9350814272=
EOF
}

CLUSTER="" WORKLOAD="" TPU="v5litepod-8" NUM_SLICES=1 ZONE="" PROJECT=""
DOCKER_IMAGE="" BASE_IMAGE="python:3.11" SCRIPT_DIR=$(cd "$HERE/.." && pwd) SCRIPT_DIR_SET=0
SKIP_INSTALL=0 PRIORITY="" MAX_RESTARTS="" SPOT=0 WAIT=0 XPK="xpk" EMIT_YAML="" TOPOLOGY=""
GIT_URL="" GIT_REF="" HAVE_CMD=0 BASE_IMAGE_SET=0 SERVE=0 PORT=8000 REPLICAS=1
ENVS=() CMD=()

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
    --cluster) need_value "$arg" $inline "$@"; CLUSTER=$1; shift ;;
    --workload) need_value "$arg" $inline "$@"; WORKLOAD=$1; shift ;;
    --tpu-type|--accelerator) need_value "$arg" $inline "$@"; TPU=$1; shift ;;
    --num-slices) need_value "$arg" $inline "$@"; NUM_SLICES=$1; shift ;;
    --zone) need_value "$arg" $inline "$@"; ZONE=$1; shift ;;
    --project) need_value "$arg" $inline "$@"; PROJECT=$1; shift ;;
    --docker-image) need_value "$arg" $inline "$@"; DOCKER_IMAGE=$1; shift ;;
    --base-docker-image) need_value "$arg" $inline "$@"; BASE_IMAGE=$1; BASE_IMAGE_SET=1; shift ;;
    --script-dir) need_value "$arg" $inline "$@"; SCRIPT_DIR=$1; SCRIPT_DIR_SET=1; shift ;;
    --skip-install) no_value "$arg" $inline; SKIP_INSTALL=1 ;;
    --priority) need_value "$arg" $inline "$@"; PRIORITY=$1; shift ;;
    --max-restarts) need_value "$arg" $inline "$@"; MAX_RESTARTS=$1; shift ;;
    --spot) no_value "$arg" $inline; SPOT=1 ;;
    --env) need_value "$arg" $inline "$@"; check_env_assignment "$1"; ENVS+=("$1"); shift ;;
    --wait) no_value "$arg" $inline; WAIT=1 ;;
    --xpk) need_value "$arg" $inline "$@"; XPK=$1; shift ;;
    --emit-yaml) need_value "$arg" $inline "$@"; EMIT_YAML=$1; shift ;;
    --topology) need_value "$arg" $inline "$@"; TOPOLOGY=$1; shift ;;
    --git-url) need_value "$arg" $inline "$@"; GIT_URL=$1; shift ;;
    --git-ref) need_value "$arg" $inline "$@"; GIT_REF=$1; shift ;;
    --serve) no_value "$arg" $inline; SERVE=1 ;;
    --port) need_value "$arg" $inline "$@"; PORT=$1; shift ;;
    --replicas) need_value "$arg" $inline "$@"; REPLICAS=$1; shift ;;
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
fi
[[ $REPLICAS =~ ^[1-9][0-9]*$ ]] || die "--replicas must be a positive integer; got '$REPLICAS'"
((REPLICAS == 1 || SERVE)) || die "--replicas applies to --serve; for several slices of one program use --num-slices"
if ((SERVE)); then
  check_serve "$(normalize_tpu "$TPU")" "$PORT"
  [[ $NUM_SLICES == 1 ]] \
    || die "--serve runs one server on one slice (one host); for several servers use --replicas N with --emit-yaml"
  ((SIMULATE == 0 || SIM_HOSTS == 1)) \
    || die "--serve runs the server on one host (one host per replica); simulate that with --simulate 1"
  serve_command "$PORT" "${CMD[@]}"
  CMD=("${SERVE_CMD[@]}")
  HAVE_CMD=1
fi
((HAVE_CMD && ${#CMD[@]} > 0)) || die "no command given; put the command to run after '--'"
((SIMULATE)) || [[ -n $EMIT_YAML || -n $CLUSTER ]] || die "--cluster is required (or use --emit-yaml to write a JobSet manifest)"
if [[ -n $CLUSTER && ! $CLUSTER =~ ^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$ ]]; then
  die "--cluster '$CLUSTER' is not a valid GKE cluster name"
fi
[[ -n $WORKLOAD ]] || WORKLOAD="dgemma-$(date +%Y%m%d-%H%M%S)"
[[ $WORKLOAD =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ && ${#WORKLOAD} -le 40 ]] \
  || die "--workload '$WORKLOAD' must be lowercase letters, digits and '-', start with a letter, end with a letter or digit, and have at most 40 characters"
TPU=$(normalize_tpu "$TPU")
check_tpu_type --tpu-type "$TPU"
[[ $NUM_SLICES =~ ^[1-9][0-9]*$ ]] || die "--num-slices must be a positive integer; got '$NUM_SLICES'"
if [[ -n $ZONE && ! $ZONE =~ ^[a-z]+-[a-z]+[0-9]+(-[a-z])?$ ]]; then
  die "--zone '$ZONE' does not look like a zone or region (e.g. us-east5-b)"
fi
if [[ -n $PROJECT && ! $PROJECT =~ ^[a-z][-a-z0-9.:]*[a-z0-9]$ ]]; then
  die "--project '$PROJECT' is not a valid project id"
fi
if [[ -n $PRIORITY ]]; then
  case $PRIORITY in very-low|low|medium|high|very-high) ;; *)
    die "--priority must be one of very-low, low, medium, high, very-high; got '$PRIORITY'" ;; esac
fi
[[ -z $MAX_RESTARTS || $MAX_RESTARTS =~ ^[0-9]+$ ]] || die "--max-restarts must be a non-negative integer; got '$MAX_RESTARTS'"
if [[ -n $DOCKER_IMAGE ]]; then
  ((BASE_IMAGE_SET == 0)) || die "--docker-image and --base-docker-image exclude each other"
  ((SCRIPT_DIR_SET == 0)) || die "--script-dir only applies with --base-docker-image (XPK copies it into that image)"
fi
if [[ -z $EMIT_YAML ]]; then
  ((REPLICAS == 1)) || die "--replicas needs --emit-yaml (xpk's --num-slices would join the slices into one program)"
  [[ -z $GIT_URL && -z $GIT_REF && -z $TOPOLOGY ]] || die "--git-url, --git-ref and --topology only apply with --emit-yaml"
  if [[ -z $DOCKER_IMAGE ]]; then
    [[ -d $SCRIPT_DIR ]] || die "--script-dir '$SCRIPT_DIR' is not a directory"
    ((SKIP_INSTALL)) || [[ -f $SCRIPT_DIR/setup.py ]] \
      || die "--script-dir '$SCRIPT_DIR' is not a dgemma_jax checkout (no setup.py); pass --skip-install if the image already has it"
  fi
else
  ((WAIT == 0)) || die "--wait needs xpk; it does not apply with --emit-yaml"
  [[ -n $DOCKER_IMAGE || -n $GIT_URL ]] \
    || die "--emit-yaml needs --docker-image (an image with dgemma_jax installed) or --git-url (cloned and installed when the pod starts)"
  [[ -z $GIT_REF || -n $GIT_URL ]] || die "--git-ref needs --git-url"
fi

USER_CMD=$(shell_command "${CMD[@]}")

serve_note
# ------------------------------------------------------------------ --simulate
# What every container runs after its install step (COMMAND, with the --env variables), in this
# checkout, as SIM_HOSTS local processes; nothing is submitted or written.
if ((SIMULATE)); then
  ((DRY_RUN == 0)) || note "dry run: nothing below is executed"
  note "simulating $SIM_HOSTS host(s) here instead of a cluster: no xpk, no manifest, no install; this checkout as it is"
  sim_venv=${VIRTUAL_ENV:-}
  [[ -z $sim_venv ]] || sim_venv=$(q "$sim_venv")
  ((SERVE == 0)) || note "serving on host 0: http://localhost:$PORT/v1 while this runs"
  rc=0
  simulate "$(host_command "$(q "$SCRIPT_DIR")" "$sim_venv" "${CMD[@]}")" || rc=$?
  exit "$rc"
fi

# ------------------------------------------------------------------ xpk
if [[ -z $EMIT_YAML ]]; then
  read -r -a XPK_ARGV <<<"$XPK"
  command=$USER_CMD
  if [[ -z $DOCKER_IMAGE ]] && ((SKIP_INSTALL == 0)); then
    command="pip install --quiet -e '.[tpu]' && $USER_CMD"
  fi
  argv=("${XPK_ARGV[@]}" workload create --cluster="$CLUSTER" --workload="$WORKLOAD" --tpu-type="$TPU"
        --num-slices="$NUM_SLICES")
  [[ -z $ZONE ]] || argv+=(--zone="$ZONE")
  [[ -z $PROJECT ]] || argv+=(--project="$PROJECT")
  if [[ -n $DOCKER_IMAGE ]]; then
    argv+=(--docker-image="$DOCKER_IMAGE")
  else
    argv+=(--base-docker-image="$BASE_IMAGE" --script-dir="$SCRIPT_DIR")
  fi
  [[ -z $PRIORITY ]] || argv+=(--priority="$PRIORITY")
  [[ -z $MAX_RESTARTS ]] || argv+=(--max-restarts="$MAX_RESTARTS")
  ((SPOT == 0)) || argv+=(--spot)
  for kv in "${ENVS[@]}"; do argv+=(--env "$kv"); done
  argv+=(--command "$command")
  ((DRY_RUN == 0)) || note "dry run: nothing below is executed"
  note "submitting workload $WORKLOAD: $NUM_SLICES x $TPU on cluster $CLUSTER"
  run "${argv[@]}"
  if ((SERVE)); then
    note "reach the server with: kubectl port-forward \$(kubectl get pods -l jobset.sigs.k8s.io/jobset-name=$WORKLOAD -o name | head -1) $PORT:$PORT"
  fi
  if ((WAIT)); then
    wargv=("${XPK_ARGV[@]}" workload list --cluster="$CLUSTER" --wait-for-job-completion="$WORKLOAD")
    [[ -z $ZONE ]] || wargv+=(--zone="$ZONE")
    [[ -z $PROJECT ]] || wargv+=(--project="$PROJECT")
    run "${wargv[@]}"
  fi
  exit 0
fi

# ------------------------------------------------------------------ JobSet YAML
# TPU type -> GKE node labels. v5litepod/v6e sizes count chips; v4/v5p sizes count TensorCores
# (2 per chip). Hosts have 4 chips (8 for a v5e-8 / v6e-8, 1 for a single-chip slice), as XPK's node pools do.
family=${TPU%-*} size=${TPU##*-}
case $family in
  v5litepod) accel_label=tpu-v5-lite-podslice; chips=$size ;;
  v6e) accel_label=tpu-v6e-slice; chips=$size ;;
  v5p) accel_label=tpu-v5p-slice; chips=$((size / 2)) ;;
  v4) accel_label=tpu-v4-podslice; chips=$((size / 2)) ;;
  *) die "--emit-yaml supports v4, v5p, v5litepod and v6e slices; got '$TPU'" ;;
esac
if [[ -z $TOPOLOGY ]]; then
  case $family:$chips in
    v5litepod:1|v6e:1) TOPOLOGY=1x1 ;;
    v5litepod:4|v6e:4) TOPOLOGY=2x2 ;;
    v5litepod:8|v6e:8) TOPOLOGY=2x4 ;;
    v5litepod:16|v6e:16) TOPOLOGY=4x4 ;;
    v5litepod:32|v6e:32) TOPOLOGY=4x8 ;;
    v5litepod:64|v6e:64) TOPOLOGY=8x8 ;;
    v5litepod:128|v6e:128) TOPOLOGY=8x16 ;;
    v5litepod:256|v6e:256) TOPOLOGY=16x16 ;;
    v5p:4|v4:4) TOPOLOGY=2x2x1 ;;
    v5p:8|v4:8) TOPOLOGY=2x2x2 ;;
    v5p:16|v4:16) TOPOLOGY=2x2x4 ;;
    v5p:32|v4:32) TOPOLOGY=2x4x4 ;;
    v5p:64|v4:64) TOPOLOGY=4x4x4 ;;
    v5p:128|v4:128) TOPOLOGY=4x4x8 ;;
    v5p:256|v4:256) TOPOLOGY=4x8x8 ;;
    v5p:512|v4:512) TOPOLOGY=8x8x8 ;;
    *) die "no built-in topology for $TPU; pass --topology (e.g. 4x4 or 2x2x4)" ;;
  esac
fi
[[ $TOPOLOGY =~ ^[1-9][0-9]*(x[1-9][0-9]*){1,2}$ ]] || die "--topology '$TOPOLOGY' must look like 2x4 or 2x2x1"
topo_chips=1
IFS=x read -r -a dims <<<"$TOPOLOGY"
for d in "${dims[@]}"; do topo_chips=$((topo_chips * d)); done
((topo_chips == chips)) || die "--topology $TOPOLOGY has $topo_chips chips but $TPU has $chips"
chips_per_host=4
((chips > 1)) || chips_per_host=1
# a v5e-8 / v6e-8 (2x4) is one 8-chip host (ct5lp-hightpu-8t, ct6e-standard-8t); bigger ones are 4-chip hosts
[[ ($family == v5litepod || $family == v6e) && $chips == 8 ]] && chips_per_host=8
hosts=$(((chips + chips_per_host - 1) / chips_per_host))
image=${DOCKER_IMAGE:-$BASE_IMAGE}

script="set -euo pipefail"
if [[ -n $GIT_URL ]]; then
  script+=$'\n'"git clone --quiet $(q "$GIT_URL") /app"
  [[ -z $GIT_REF ]] || script+=$'\n'"git -C /app checkout --quiet $(q "$GIT_REF")"
  script+=$'\n'"cd /app"
  ((SKIP_INSTALL)) || script+=$'\n'"pip install --quiet -e '.[tpu]'"
fi
script+=$'\n'"$USER_CMD"

yaml_str() {  # a YAML double-quoted scalar (JSON string rules)
  local s=$1
  s=${s//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\n'/\\n}
  s=${s//$'\t'/\\t}
  s=${s//$'\r'/\\r}
  printf '"%s"' "$s"
}

emit() {
  echo "# JobSet for DiffusionGemma (dgemma_jax), written by launch/gke_xpk.sh --emit-yaml."
  echo "# $NUM_SLICES x $TPU: topology $TOPOLOGY, $hosts host(s) per slice, $chips_per_host chip(s) per host."
  ((SERVE == 0)) || echo "# Serving: $REPLICAS independent server(s), one slice each, behind the Service $WORKLOAD."
  echo "# Apply with: kubectl apply -f FILE   (needs the JobSet controller on the cluster)"
  echo "apiVersion: jobset.x-k8s.io/v1alpha2"
  echo "kind: JobSet"
  echo "metadata:"
  echo "  name: $WORKLOAD"
  echo "  annotations:"
  echo "    alpha.jobset.sigs.k8s.io/exclusive-topology: cloud.google.com/gke-nodepool"
  echo "spec:"
  echo "  failurePolicy:"
  echo "    maxRestarts: ${MAX_RESTARTS:-0}"
  echo "  replicatedJobs:"
  echo "  - name: slice"
  echo "    replicas: $((NUM_SLICES * REPLICAS))"
  echo "    template:"
  echo "      spec:"
  echo "        parallelism: $hosts"
  echo "        completions: $hosts"
  echo "        backoffLimit: 0"
  echo "        template:"
  echo "          spec:"
  echo "            restartPolicy: Never"
  echo "            nodeSelector:"
  echo "              cloud.google.com/gke-tpu-accelerator: $accel_label"
  echo "              cloud.google.com/gke-tpu-topology: $TOPOLOGY"
  ((SPOT == 0)) || echo "              cloud.google.com/gke-spot: \"true\""
  if ((SPOT)); then
    echo "            tolerations:"
    echo "            - key: cloud.google.com/gke-spot"
    echo "              operator: Equal"
    echo "              value: \"true\""
    echo "              effect: NoSchedule"
  fi
  echo "            containers:"
  echo "            - name: dgemma"
  echo "              image: $(yaml_str "$image")"
  echo "              command: [\"bash\", \"-c\"]"
  echo "              args:"
  echo "              - |"
  local line
  while IFS= read -r line; do echo "                $line"; done <<<"$script"
  echo "              ports:"
  echo "              - containerPort: 8471"
  echo "              - containerPort: 8080"
  if ((SERVE)); then
    echo "              - containerPort: $PORT"
    echo "              readinessProbe:"
    echo "                httpGet:"
    echo "                  path: /health"
    echo "                  port: $PORT"
    echo "                periodSeconds: 10"
  fi
  echo "              securityContext:"
  echo "                privileged: true"
  if ((${#ENVS[@]} > 0 || NUM_SLICES > 1)); then
    echo "              env:"
    local kv
    for kv in "${ENVS[@]}"; do
      echo "              - name: ${kv%%=*}"
      echo "                value: $(yaml_str "${kv#*=}")"
    done
    if ((NUM_SLICES > 1)); then
      echo "              - name: JOBSET_NAME"
      echo "                valueFrom:"
      echo "                  fieldRef:"
      echo "                    fieldPath: metadata.annotations['jobset.sigs.k8s.io/jobset-name']"
      echo "              - name: MEGASCALE_COORDINATOR_ADDRESS"
      echo "                value: \"\$(JOBSET_NAME)-slice-0-0.\$(JOBSET_NAME)\""
      echo "              - name: MEGASCALE_NUM_SLICES"
      echo "                value: \"$NUM_SLICES\""
      echo "              - name: MEGASCALE_SLICE_ID"
      echo "                valueFrom:"
      echo "                  fieldRef:"
      echo "                    fieldPath: metadata.annotations['jobset.sigs.k8s.io/job-index']"
      echo "              - name: MEGASCALE_PORT"
      echo "                value: \"8080\""
    fi
  fi
  echo "              resources:"
  echo "                limits:"
  echo "                  google.com/tpu: $chips_per_host"
  if ((SERVE)); then
    echo "---"
    echo "# The servers' address inside the cluster (connections go to the ready replicas);"
    echo "# from outside: kubectl port-forward svc/$WORKLOAD $PORT:$PORT"
    echo "apiVersion: v1"
    echo "kind: Service"
    echo "metadata:"
    echo "  name: $WORKLOAD"
    echo "spec:"
    echo "  selector:"
    echo "    jobset.sigs.k8s.io/jobset-name: $WORKLOAD"
    echo "  ports:"
    echo "  - name: http"
    echo "    port: $PORT"
    echo "    targetPort: $PORT"
  fi
}

if [[ $EMIT_YAML == - ]]; then
  emit
else
  if ((DRY_RUN)); then
    note "dry run: would write the JobSet manifest to $EMIT_YAML"
  else
    emit >"$EMIT_YAML"
    note "wrote $EMIT_YAML"
  fi
  note "submit it with: $(join_quoted kubectl apply -f "$EMIT_YAML")"
fi
