# agentrl command runner, run by bash inside a sandbox as: bash RUNNER TIMEOUT CAP NONCE OUTDIR CMD
#
# Why a runner: a plain exec of CMD has no timeout, stalls while any background process it
# started holds its output stream, and cannot tell an OOM kill from a normal 137. The runner
#  - runs CMD as its own process group (job control), output to a file, so background processes
#    hold the file and not the caller's stream;
#  - runs a watchdog beside CMD; on timeout it kills CMD's process group and then every
#    process that carries this command's marker in its environment (children that moved to a
#    new session or process group still inherit it);
#  - reads the cgroup's oom_kill counter before and after;
#  - prints CMD's output (head and tail only when above CAP bytes), then one trailer line
#    (and keeps the same bytes in OUTDIR/NONCE.result for a caller whose stream was lost):
#    NONCE EXIT_CODE TIMED_OUT OOM_KILLED OUTPUT_BYTES
# Builtins are used where a fork would do, to keep the per-command cost low.
timeout_s=$1 cap=$2 nonce=$3 outdir=$4 cmd=$5
out="$outdir/$nonce"
exec 2>/dev/null  # the runner's own stderr (job notices) must not mix into the command's output

read_oom() {
    oom=0
    local f k v
    for f in /sys/fs/cgroup/memory/memory.oom_control /sys/fs/cgroup/memory.events; do
        if [ -r "$f" ]; then
            while read -r k v; do [ "$k" = oom_kill ] && oom=$v; done < "$f"
            return
        fi
    done
}

kill_marked() {
    local p e
    for p in /proc/[0-9]*; do
        while IFS= read -r -d '' e; do
            if [ "$e" = "AGENTRL_EXEC=$nonce" ]; then kill -9 "${p#/proc/}" 2>/dev/null; break; fi
        done < "$p/environ" 2>/dev/null
    done
}

read_oom; oom_before=$oom
if ! { : > "$out"; } 2>/dev/null; then
    printf 'agentrl: cannot write the output file %s (is the sandbox out of space?)\n' "$out"
    printf '\n%s %d %d %d %d\n' "$nonce" 125 0 0 0
    exit 0
fi
set -m  # job control: each background job below gets its own process group
AGENTRL_EXEC=$nonce bash -c "$cmd" > "$out" 2>&1 < /dev/null &
pid=$!
(
    sleep "$timeout_s"
    : > "$out.timeout"
    for _ in 1 2 3; do kill -9 -- "-$pid"; kill_marked; done
) > /dev/null 2>&1 < /dev/null &
dog=$!
wait "$pid"
rc=$?
timed_out=0
if [ -e "$out.timeout" ]; then
    # The watchdog fired: let it finish hunting down escaped processes before going on.
    wait "$dog"
    timed_out=1 rc=124
    rm -f "$out.timeout"
else
    kill -9 -- "-$dog"
fi
read_oom; oom_killed=0
[ "$oom" -gt "$oom_before" ] && oom_killed=1
size=$(stat -c %s "$out" 2>/dev/null || echo 0)
# The result is kept in a file as well as printed: a heavily loaded daemon has been seen to drop the
# output of a quick exec, and the caller can then read it back (results older than 10 min are removed).
{
    if [ "$size" -gt "$cap" ]; then
        head -c $((cap / 2)) "$out"
        tail -c $((cap - cap / 2)) "$out"
    else
        cat "$out"
    fi
    printf '\n%s %d %d %d %d\n' "$nonce" "$rc" "$timed_out" "$oom_killed" "$size"
} > "$out.result"
rm -f "$out"
cat "$out.result"
find "$outdir" -name '*.result' -mmin +10 -delete 2>/dev/null
