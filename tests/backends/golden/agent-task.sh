#!/bin/bash
# rlctl job demo: the srun task on every allocated node. Starts the node agent with the
# 0600 config the controller writes for this node and allocation; starts it again whenever the
# controller writes a new config (a new file = a new inode), records the agent's state in a
# status file, and exits when a stop marker appears (release) or Slurm ends the allocation; then
# the job's role workers on this node go too (they run in their own sessions, so neither the
# agent's process group nor Slurm's process tracking reaches them once the agent is gone).
# Rendered by rlctl.backends.slurm from templates/slurm_agent_task.sh.j2 -- do not edit.
set -u
dir=/jobs/demo/slurm/agents
key="${SLURMD_NODENAME}-${SLURM_JOB_ID}"
cfg="$dir/$key.json"
status="$dir/$key.status"
stop="$dir/$key.stop"
gen=""
pid=""
echo "waiting" >"$status"
stop_agent() {
  [ -n "$pid" ] || return 0
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  pid=""
}
# The job's workers on this node: the agent gives them RLCTL_JOB_ID and RLCTL_NODE.
job_workers() {
  grep -lzxF "RLCTL_JOB_ID=demo" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 | while read -r w; do
    [ "$w" != "$$" ] && grep -qzxF "RLCTL_NODE=${SLURMD_NODENAME}" "/proc/$w/environ" 2>/dev/null && echo "$w"
  done
}
stop_workers() {
  local w live
  w=$(job_workers)
  [ -n "$w" ] || return 0
  for x in $w; do kill -TERM -- "-$x" 2>/dev/null || kill -TERM "$x" 2>/dev/null; done
  for _ in $(seq 50); do
    live=""
    for x in $w; do kill -0 "$x" 2>/dev/null && live=1; done
    [ -z "$live" ] && break
    sleep 0.1
  done
  for x in $w; do kill -KILL -- "-$x" 2>/dev/null; kill -KILL "$x" 2>/dev/null; done
}
trap 'stop_agent; stop_workers; echo "stopped" >"$status"; exit 0' TERM INT
while [ ! -e "$stop" ]; do
  now=$(stat -c %i "$cfg" 2>/dev/null || true)
  if [ -n "$now" ] && [ "$now" != "$gen" ]; then
    stop_agent
    gen=$now
    python3 /jobs/demo/slurm/agent.pyz --config "$cfg" >>"$dir/$key.log" 2>&1 </dev/null &
    pid=$!
    echo "running $pid $gen" >"$status"
  fi
  if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then
    wait "$pid"
    echo "exited $? $gen" >"$status"
    pid=""
  fi
  sleep 0.2
done
stop_agent
stop_workers
echo "stopped" >"$status"
