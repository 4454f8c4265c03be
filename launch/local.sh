#!/usr/bin/env bash
# N training processes on this machine, joined by JAX's own distributed runtime (Gloo on CPU,
# NCCL on GPU): for a multi-GPU node, and for testing multi-host code on a laptop.
#
#   launch/local.sh N [--config configs/tiny.yaml] [section.key=value ...]
#
# Each process gets JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>, JAX_NUM_PROCESSES=N and its
# JAX_PROCESS_ID, then runs `python -m trainer.main` with the remaining arguments. Devices:
#   gpu: the GPUs nvidia-smi lists, split evenly (CUDA_VISIBLE_DEVICES), e.g. one GPU each;
#   cpu: LOCAL_CPU_DEVICES fake CPU devices split evenly (XLA_FLAGS), e.g. 2 x 4 for 8, and
#        glibc's huge pages for large allocations (GLIBC_TUNABLES, unless already set).
# The launcher waits for all of them. When one exits non-zero it names it (its process index,
# and the signal that killed it), stops the others (SIGTERM, then SIGKILL after
# LOCAL_KILL_GRACE_S), says what to do, and exits with that status; re-running the same command
# resumes from the latest checkpoint. SIGTERM to the launcher goes to every process, and Ctrl-C
# reaches them from the terminal: they agree on a step, save, and stop (before their first step,
# each ends with one line, exit 130).
#
# Knobs (environment):
#   PYTHON               interpreter (default: python)
#   LOCAL_DEVICE         cpu | gpu (default: gpu when nvidia-smi lists at least N GPUs)
#   LOCAL_CPU_DEVICES    total fake CPU devices, a multiple of N (default: 8)
#   JAX_COORDINATOR_PORT coordinator port on 127.0.0.1 (default: a free one, which the launcher
#                        keeps bound until it ends, so that nothing else takes it first)
#   LOCAL_KILL_GRACE_S   seconds between SIGTERM and SIGKILL when one process failed (default: 10)
# Only sets variables and starts processes: install the project first (see README.md).
set -uo pipefail

usage="usage: launch/local.sh N [--config FILE] [section.key=value ...]"
# whole_number NAME VALUE MIN [HINT]: one line and exit 2 unless VALUE is a whole number >= MIN
whole_number() {
  if [[ ! $2 =~ ^[0-9]+$ ]] || ((10#$2 < $3)); then
    echo "local.sh: $1=$2 is not a whole number >= $3; give $1 as one${4:+ ($4)}" >&2
    exit 2
  fi
}
[[ $# -ge 1 ]] || { echo "$usage" >&2; exit 2; }
whole_number N "$1" 1 "$usage"
num_processes=$((10#$1))
shift
python=${PYTHON:-python}
if ! command -v "$python" >/dev/null; then
  echo "local.sh: PYTHON=$python is not a command here; set PYTHON to the interpreter with the" \
    "project installed" >&2
  exit 2
fi
grace=${LOCAL_KILL_GRACE_S:-10}
if [[ ! $grace =~ ^[0-9]+(\.[0-9]+)?$ ]]; then
  echo "local.sh: LOCAL_KILL_GRACE_S=$grace is not a number of seconds; give it as one, e.g. 10" >&2
  exit 2
fi

device=${LOCAL_DEVICE:-}
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
fi
if [[ -z $device ]]; then
  if ((gpus >= num_processes)); then device=gpu; else device=cpu; fi
fi
case $device in
  gpu)
    if ((gpus < num_processes)); then
      echo "local.sh: LOCAL_DEVICE=gpu but nvidia-smi lists $gpus GPU(s) for $num_processes" \
        "processes; start fewer processes, or set LOCAL_DEVICE=cpu" >&2
      exit 2
    fi
    per_process=$((gpus / num_processes)) ;;
  cpu)
    cpu_devices=${LOCAL_CPU_DEVICES:-8}
    whole_number LOCAL_CPU_DEVICES "$cpu_devices" 1
    cpu_devices=$((10#$cpu_devices))
    if ((cpu_devices % num_processes)); then
      echo "local.sh: LOCAL_CPU_DEVICES=$cpu_devices does not split over $num_processes" \
        "processes; use a multiple of $num_processes" >&2
      exit 2
    fi
    per_process=$((cpu_devices / num_processes))
    # Our device count replaces any inherited one (pytest's conftest sets 8).
    xla_flags=$(sed -E 's/--xla_force_host_platform_device_count=[0-9]+//g' <<<"${XLA_FLAGS:-}")
    export XLA_FLAGS="$xla_flags --xla_force_host_platform_device_count=$per_process"
    export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
    # huge pages for XLA:CPU's large per-step temporaries (README "Running on CPU")
    export GLIBC_TUNABLES=${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1} ;;
  *)
    echo "local.sh: LOCAL_DEVICE=$device is neither cpu nor gpu; set it to one of them" >&2
    exit 2 ;;
esac

# A free port, bound until this launcher ends (its end of the holder's stdin closes): on every
# interface with SO_REUSEADDR, as the coordinator binds, and never listening. Automatic port
# choices (bind to port 0, outgoing connections) skip it and a plain bind there fails, while
# process 0's coordinator can still listen on it. A port found free and let go was anyone's in
# the seconds before the coordinator bound it, and the run ended on process 0's "port P ... is
# already in use" line. (Ctrl-C is for the training processes: the holder ignores it.)
hold_free_port='
import signal, socket, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
try:
    holder = socket.socket(socket.AF_INET6)
    holder.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    host = "::"
except OSError:  # no IPv6 on this host
    holder, host = socket.socket(socket.AF_INET), "0.0.0.0"
holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
holder.bind((host, 0))
print(holder.getsockname()[1], flush=True)
sys.stdin.read()
'
if [[ -n ${JAX_COORDINATOR_PORT:-} ]]; then
  port=$JAX_COORDINATOR_PORT
  whole_number JAX_COORDINATOR_PORT "$port" 1
else
  coproc port_holder { exec "$python" -c "$hold_free_port"; }
  holder=$port_holder_PID
  port=""
  from_holder=${port_holder[0]:-} # unset already if the holder ended at once
  [[ -z $from_holder ]] || read -r port 2>/dev/null <&"$from_holder"
  if [[ ! $port =~ ^[0-9]+$ ]]; then
    echo "local.sh: PYTHON=$python could not hold a free port for the coordinator; set" \
      "JAX_COORDINATOR_PORT to a free port" >&2
    exit 2
  fi
fi
export JAX_COORDINATOR_ADDRESS=127.0.0.1:$port JAX_NUM_PROCESSES=$num_processes

# read_alive: sets alive_now to bash's own record of its children still running, one pid a line
# between newlines; 1 if it could not be read (a signal to the whole group can end the subshell
# that reads it). A child that ended is reaped at once and its pid is the kernel's to give out
# again: `kill -0 PID` could find another process there (and kept the launcher polling that one
# for as long as it lived, or signalled it).
read_alive() {
  alive_now=$(jobs -rp; echo .)
  [[ $alive_now == *. ]] || return 1
  alive_now=$'\n'${alive_now%.}
}
is_alive() {
  [[ $alive_now == *$'\n'$1$'\n'* ]]
}

# first_ended: sets finished and rc for a process of running[] that has ended; 1 if none has.
# (`wait -n` missed a process that ended while the shell ran a trap or reaped another one, as
# when one Ctrl-C ends them all, and then waited for ever; `wait PID` never misses one.)
first_ended() {
  local pid
  read_alive || return 1
  for pid in "${running[@]}"; do
    if ! is_alive "$pid"; then
      finished=$pid
      wait "$pid"
      rc=$?
      return 0
    fi
  done
  return 1
}

# signal_running SIGNAL: sends SIGNAL to the processes of running[] that still run
signal_running() {
  local pid targets=()
  if read_alive; then
    for pid in "${running[@]}"; do
      is_alive "$pid" && targets+=("$pid")
    done
  else
    targets=("${running[@]}")
  fi
  ((${#targets[@]} == 0)) || kill -"$1" "${targets[@]}" 2>/dev/null
}

# SIGKILL timer: a `sleep` of our own, watched by the wait loop, so that ending it ends it all
# (a timer subshell ended at exit left its `sleep` behind for the rest of the grace period). It
# ignores SIGTERM and SIGHUP: those sent to the launcher's whole group must not cut the grace
# short (nor, as they did to the subshell, cancel the SIGKILL).
killer=""
start_killer() {
  (trap '' TERM HUP; exec sleep "$grace") >/dev/null 2>&1 &
  killer=$!
}
killer_rang() {
  [[ -n $killer ]] && read_alive && ! is_alive "$killer"
}
stop_killer() {
  if [[ -n $killer ]]; then
    if ! read_alive || is_alive "$killer"; then kill -KILL "$killer" 2>/dev/null; fi
    wait "$killer" 2>/dev/null
    killer=""
  fi
}

# describe_end PID STATUS: sets ended to which process ended and how, as its own lines name it
# (process i). Builtins only, no subshell: a signal to the whole group could end one.
describe_end() {
  local i index=? signal
  for i in "${!pids[@]}"; do [[ ${pids[i]} != "$1" ]] || index=$i; done
  case $2 in
    129) signal=HUP ;; 134) signal=ABRT ;; 135) signal=BUS ;;
    137) signal=KILL ;; 139) signal=SEGV ;; 143) signal=TERM ;; *) signal="" ;;
  esac
  if [[ -n $signal ]]; then
    ended="process $index (pid $1) was killed by SIG$signal (status $2)"
  else
    ended="process $index (pid $1) exited with status $2"
  fi
}

# what_to_do STATUS: the launcher's last line after a failed run
what_to_do() {
  local resume="re-run the same command to resume from the latest checkpoint"
  case $1 in
    2) echo "local.sh: fix the error above (status 2: bad input), then $resume" >&2 ;;
    3) echo "local.sh: a process was stuck (status 3: its stacks above); $resume" >&2 ;;
    *) echo "local.sh: $resume (status $1)" >&2 ;;
  esac
}

pids=()
running=() # the processes not yet seen to end (signals go to those of them still running)
trap 'signal_running TERM' TERM
trap ':' INT # Ctrl-C reaches every process from the terminal; the launcher waits for them
for ((i = 0; i < num_processes; i++)); do
  (
    # A script's background job starts with SIGINT ignored, and Python keeps that: a Ctrl-C
    # before the training loop (which handles SIGINT itself) was lost on the processes.
    trap - INT
    if [[ $device == gpu ]]; then
      CUDA_VISIBLE_DEVICES=$(seq -s, $((i * per_process)) $(((i + 1) * per_process - 1)))
      export CUDA_VISIBLE_DEVICES
    fi
    JAX_PROCESS_ID=$i exec "$python" -m trainer.main "$@"
  ) &
  pids+=($!)
  running+=($!)
done
echo "local.sh: $num_processes processes (${pids[*]}) on $device, $per_process device(s) each," \
  "coordinator $JAX_COORDINATOR_ADDRESS" >&2

status=0
while ((${#running[@]})); do
  if ! first_ended; then
    if killer_rang; then
      stop_killer
      signal_running KILL
    fi
    # (the braces keep bash's "Terminated" line to itself when a signal ends the sleep)
    { sleep 0.2; } 2>/dev/null
    continue
  fi
  still=() # builtins only: a signal to the whole group could end a pipeline's subshell
  for pid in "${running[@]}"; do [[ $pid == "$finished" ]] || still+=("$pid"); done
  running=("${still[@]}")
  if ((rc != 0 && status == 0)); then
    status=$rc
    describe_end "$finished" "$rc"
    echo "local.sh: $ended; stopping the others" >&2
    if ((${#running[@]})); then
      signal_running TERM
      start_killer
    fi
  fi
done
stop_killer
((status == 0)) || what_to_do "$status"
# The port holder ends when its stdin closes: close it and wait, so that it does not outlive us.
if [[ -n ${holder:-} ]]; then
  to_holder=${port_holder[1]:-}
  [[ -z $to_holder ]] || exec {to_holder}>&-
  wait "$holder" 2>/dev/null
fi
exit "$status"
