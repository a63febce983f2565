# agentrl command runner, run by bash as root inside a Docker sandbox:
#     AGENTRL_TRAILER=SECRET bash RUNNER TIMEOUT CAP TAG OUTDIR UID GID RESULTDIR FRESH CMD [CMD ...]
#
# Why a runner: a plain exec of CMD has no timeout, stalls while any background process it
# started holds its output stream, and cannot tell an OOM kill or a fork bomb from a normal exit.
# The runner
#  - runs CMD as the sandbox user (UID:GID, through setpriv) in its own process group (job
#    control), its output in a root-only file, so background processes hold that file and not the
#    caller's stream. The runner itself stays root: the agent cannot kill it or read its files;
#  - runs a watchdog beside CMD. At the deadline it stops every process of UID at once (kill(-1)
#    as UID), kills those started since the runner began and lets the older ones go on: a child
#    that left the group or the session, or dropped its environment, still has its uid and its
#    start time, and one that keeps forking cannot slip past a signal sent to all at once. When
#    the container's pids limit refuses a fork (a fork bomb), it stops and kills every process of
#    UID, so that the sandbox can fork again; it wakes ten times a second with builtins only;
#  - reads the cgroup's oom_kill and pids "max" counters before and after, and the pids one against
#    where the last command left it (a fork bomb in the background can reach the limit in between),
#    unless FRESH is 1: the caller has killed the user's processes since (a reset, a recovery);
#  - keeps room for CMD's first CAP bytes (up to 1 MiB) of output. An output file is deleted when
#    its command ends, but a background process may still write to it: where there is no room,
#    such files are emptied first;
#  - prints CMD's output (head and tail only when above CAP bytes), then one trailer line
#    (and keeps the same bytes in RESULTDIR/TAG.result, a tmpfs of its own that no output file
#    can fill, for a caller whose stream was lost):
#    SECRET EXIT_CODE TIMED_OUT OOM_KILLED OUTPUT_BYTES PIDS_EXHAUSTED
#    SECRET comes in the environment, which CMD does not inherit and, as another user, cannot read
#    from /proc (the arguments, TAG included, it can): so CMD cannot print a trailer of its own that
#    the caller would take for the runner's when the real one is lost.
timeout_s=$1 cap=$2 tag=$3 outdir=$4 uid=$5 gid=$6 resdir=$7 fresh=$8
nonce=$AGENTRL_TRAILER
unset AGENTRL_TRAILER
# A long CMD comes in pieces (one argument of a program holds at most 128 KiB, MAX_ARG_STRLEN)
shift 8
pieces=$#
printf -v cmd %s "$@"
out="$outdir/$tag" res="$resdir/$tag.result"
exec 2>/dev/null  # the runner's own stderr (job notices) must not mix into the command's output

counter() {  # counter FILE KEY: the value of KEY in a cgroup stats file, in $value (0 when absent)
    local k v
    value=0
    [ -r "$1" ] || return
    while read -r k v; do [ "$k" = "$2" ] && { value=$v; return; }; done < "$1"
}

counters() {
    counter /sys/fs/cgroup/memory/memory.oom_control oom_kill; oom=$value
    [ -r /sys/fs/cgroup/memory.events ] && { counter /sys/fs/cgroup/memory.events oom_kill; oom=$value; }
    counter /sys/fs/cgroup/pids/pids.events max; pids=$value
    [ -r /sys/fs/cgroup/pids.events ] && { counter /sys/fs/cgroup/pids.events max; pids=$value; }
}

stat_fields() {  # stat_fields PID: the fields of /proc/PID/stat after the name, from the state on, in $fields
    local line
    fields=()
    read -r line < "/proc/$1/stat" || return 1
    read -r -a fields <<< "${line##*) }"  # the name in parentheses may hold spaces
}

starttime() {  # starttime PID: the process's start in clock ticks since boot, in $value
    value=
    stat_fields "$1" || return 1
    value=${fields[19]}
}

owner() {  # owner PID: the process's real uid, in $value
    local k real rest
    value=
    while read -r k real rest; do [ "$k" = Uid: ] && { value=$real; return 0; }; done < "/proc/$1/status"
    return 1
}

targets() {  # targets new|all: pids of UID's processes (new: started since the runner), in $found
    local p pid
    found=()
    for p in /proc/[0-9]*; do
        pid=${p#/proc/}
        [ "$pid" = 1 ] || [ "$pid" = "$$" ] || [ "$pid" = "$BASHPID" ] || [ "$pid" = "$dog" ] && continue
        owner "$pid" && [ "$value" = "$uid" ] || continue
        if [ "$1" = new ]; then starttime "$pid" && [ "$value" -ge "$since" ] || continue; fi
        found+=("$pid")
    done
}

as_user_kill() {  # as_user_kill SIGNAL: kill(-1) as UID, which reaches every process of UID at once
    # (a fork that races with it is undone by the kernel), so none can fork past it. It needs a fork
    # of its own: tried only with room under the pids limit, as bash retries a refused fork for 15 s.
    local d current=0 max=max
    [ "$uid" = 0 ] && return 1  # as root it would take everything down (as_user: set before any reap)
    for d in /sys/fs/cgroup /sys/fs/cgroup/pids; do
        [ -r "$d/pids.current" ] && { read -r current < "$d/pids.current"; read -r max < "$d/pids.max"; break; }
    done
    [ "$max" = max ] || [ $((current + 16)) -lt "$max" ] || return 1
    "${as_user[@]}" bash -c "kill -$1 -1" 2> /dev/null 4<&-
}

reap() {  # reap new|all: the processes to kill (new: those the command started)
    [ "$uid" = 0 ] && [ "$1" = all ] && set -- new  # as root, "all" would take the keep-alive down
    if [ "$1" = new ] && as_user_kill STOP; then
        # Everything of UID is stopped: the rounds take the new processes for certain (a process that
        # forks and exits again and again can move to a new pid faster than a round, and survived
        # them more often than not), and the older ones (a server the agent started before) go on.
        rounds new
        targets all
        [ ${#found[@]} = 0 ] || kill -CONT "${found[@]}"
        return
    fi
    rounds "$1"
}

rounds() {  # rounds new|all: stop the processes first (a stopped process cannot fork), then kill them
    local round prev=
    # Stop rounds until one finds no process the last did not: then none was left running to fork
    # (a process that forks and exits again and again moves to a new pid faster than one round).
    for ((round = 0; round < 256; round++)); do
        targets "$1"
        [ ${#found[@]} = 0 ] && break
        kill -STOP "${found[@]}"
        [ "${found[*]}" = "$prev" ] && break
        prev=${found[*]}
    done
    for ((round = 0; round < 256; round++)); do
        targets "$1"
        [ ${#found[@]} = 0 ] && break
        kill -KILL "${found[@]}"
    done
}

end_watchdog() {  # the file ends it; the line wakes it at once (see the pipe below)
    : > "$out.end"
    printf '\n' >&4
    wait "$dog"
}
remove_files() {
    rm -f "$out" "$out.cmd" "$out.dd" "$out.timeout" "$out.pids" "$out.done" "$out.end"
}
cancel() {  # the caller gave up on the command (SIGTERM from agentrl): nothing of it may stay
    trap '' TERM  # the caller sends TERM again until the runner is gone: that must not cut this short
    # A cancel just after a fork comes before the runner has the job's pid: the last job started is
    # the watchdog, then the command (which a reap by uid misses while it is root, before setpriv)
    dog=${dog:-$!}
    [ -n "$pid" ] || [ "$!" = "$dog" ] || pid=$!
    [ -n "$pid" ] && kill -KILL -- "-$pid"
    [ -n "$dog" ] && end_watchdog
    reap new
    remove_files
    exit 143
}

# A cancel can come at any point, even before the command starts (under load, the runner's first
# steps take a second): TERM is trapped before anything is made, so that none of it stays. Before
# this point, TERM ends the runner with nothing made. A cancel that came before the runner started
# (the daemon starts an exec late under load) left a mark, looked for only once the trap is set: a
# runner that looked too early was already running when the caller sent TERM.
pid= dog=
starttime $$; since=$value
if [ "$uid" = 0 ]; then
    as_user=()
else
    as_user=(setpriv --reuid="$uid" --regid="$gid" --clear-groups --inh-caps=-all)
fi
trap cancel TERM
[ -e "$resdir/$tag.cancel" ] && { rm -f "$resdir/$tag.cancel"; exit 143; }
counters; oom_before=$oom pids_before=$pids
# A fork bomb left in the background can reach the pids limit between two commands: its processes
# then sleep in bash's fork retries (1 s, 2 s, 4 s...), through the next quick commands, none of
# which saw a fork refused. The counter as the last command left it tells (about one bomb in 30
# was missed so on 2 busy cores): all of UID is killed before this command runs, and it reports it.
bomb_before=0 seen=$pids
[ "$fresh" != 1 ] && [ -r "$resdir/pids.seen" ] && read -r seen < "$resdir/pids.seen"
if [ "$pids" -gt "${seen:-$pids}" ]; then
    bomb_before=1
    reap all
    counters; pids_before=$pids  # the forks the bomb's last processes tried as they were killed
fi
# The output file, writable by UID (see below; only its processes' descriptors reach it), and room
# for the command's first output, which a background writer cannot take then (the command appends:
# a redirection that truncates would give the room back). In one subshell: the command inherits the
# runner's umask, which stays as it was.
room=$((cap < 1048576 ? cap : 1048576))
(umask 0 && : > "$out" || exit 125; exec fallocate --keep-size --length "$room" "$out") 2> /dev/null
made=$?
if [ "$made" = 125 ]; then
    printf 'agentrl: cannot write the output file %s (is the sandbox out of space?)\n' "$out"
    printf '\n%s %d %d %d %d %d\n' "$nonce" 125 0 0 0 0
    exit 0
fi
if [ "$made" != 0 ]; then
    # No room: output files of earlier commands that their background processes still write to are
    # emptied (the writers go on at their offsets, and a hole takes no room on a tmpfs). As UID:
    # root without CAP_SYS_PTRACE cannot see another user's open files, and UID may write them.
    "${as_user[@]}" find /proc/[0-9]*/fd -lname "$outdir/* (deleted)" -exec truncate --size 0 {} + 2> /dev/null
    fallocate --keep-size --length "$room" "$out" 2> /dev/null
fi
# The watchdog's sleep: read -t on this pipe (a sleep without a fork). To end it, the runner makes the
# file $out.end, which the watchdog looks for at every tick, and writes a line to the pipe to wake it
# at once. The file is what ends it: bash's read -t can take the line and still report a timeout
# (when its 0.1 s ran out while it read), and a SIGTERM, what the runner sent before, was lost now
# and then under load (32 sandboxes on 2 cores): the runner waited on the watchdog until the caller
# gave the sandbox up for dead. Opened before the fork, so that a line written early stays in the pipe.
# A process substitution's pipe, opened for reading and writing: a fork, where a fifo took mkfifo's
# fork and exec (1 ms of the runner's 15 for a quick command) and a file to remove.
exec 4<> <(:)
# The watchdog is forked before the command: a fork bomb may leave no process to fork it after.
# It runs until the runner has written the result (a bomb can start in the background and reach the
# limit only then), and never stops half-way through a reap (stopped processes would stay). SIGTERM
# (from a caller's cancel, which signals the runner's processes by pattern) ends it the same way.
(
    reaping=0 stop=0
    trap '[ "$reaping" = 1 ] && stop=1 || exit 0' TERM
    now=${EPOCHREALTIME/./}
    ms=${timeout_s/./}
    deadline=$((now + 10#$ms * 1000))
    while :; do
        read -r -t 0.1 -u 4
        [ -e "$out.end" ] && exit 0
        [ -e "/proc/$$" ] || exit 0  # a runner killed outright: at its deadline this would reap later commands
        counters
        if [ "$pids" -gt "$pids_before" ]; then
            reaping=1
            : > "$out.pids"
            reap all
            pids_before=$pids reaping=0
            [ "$stop" = 1 ] && exit 0
        fi
        [ -e "$out.done" ] && continue
        now=${EPOCHREALTIME/./}
        if [ "$now" -ge "$deadline" ]; then
            reaping=1
            : > "$out.timeout"
            reap new  # the command's process group and everything that left it
            exit 0
        fi
    done
) > /dev/null 2>&1 < /dev/null &
dog=$!
set -m  # job control: the command below gets a process group of its own
if [ "$pieces" -gt 1 ]; then
    # too long for `bash -c` (one argument): bash reads it from a file, opened here and handed down
    # as fd 3 (the user cannot reach OUTDIR by path; the script closes fd 3 first)
    printf 'exec 3<&-; %s' "$cmd" > "$out.cmd"
    chmod 444 "$out.cmd"
    "${as_user[@]}" bash /dev/fd/3 3< "$out.cmd" >> "$out" 2>&1 < /dev/null 4<&- &
else
    "${as_user[@]}" bash -c "$cmd" >> "$out" 2>&1 < /dev/null 4<&- &
fi
pid=$!
# Until the command has ended, not when it is stopped (the watchdog stops every process before it
# kills; a command can stop itself). Not `wait -f`: under load, bash 5.2's spun at full CPU in its
# wait loop ("No record of process"), after the watchdog had stopped and killed a timed-out
# command, about once in 500 timeouts with 32 sandboxes on 2 cores, until the caller gave the
# sandbox up for dead. A stop ends `wait` with a status above 128: the process state tells it from
# an end (stopped: wait again, after a tick; not yet reaped: wait again at once).
while :; do
    wait "$pid"
    rc=$?
    [ "$rc" -gt 128 ] || break
    stat_fields "$pid" || break  # gone: it has ended
    case ${fields[0]} in
    T | t) read -r -t 0.05 -u 4 ;;  # the pipe of the watchdog's wake-ups: written only after this
    Z) ;;
    *) break ;;
    esac
done
: > "$out.done"
timed_out=0
if [ -e "$out.timeout" ]; then
    wait "$dog"  # let it finish hunting down escaped processes before going on
    timed_out=1 rc=124
fi
shown() {  # the output returned: its head and tail only when above CAP bytes
    if [ "$size" -gt "$cap" ]; then
        head -c $((cap / 2)) "$out" &&
        tail -c $((cap - cap / 2)) "$out"
    else
        cat "$out"
    fi
}
# The result is kept in a file as well as printed: a heavily loaded daemon has been seen to drop the
# output of a quick exec, and the caller can then read it back (results older than 10 min are removed).
# One program copies the output into the result and counts it (dd reports the bytes it copied), where
# stat and cat took two: up to CAP + 1 bytes, so that a longer output shows as one, kept as its head
# and tail. The size is that of the bytes kept, though a background process may write on.
kept=0 size=
LC_ALL=C dd if="$out" of="$res" bs=64K iflag=count_bytes count=$((cap + 1)) 2> "$out.dd"
copied=$?
while read -r bytes word _; do [[ $word = byte* ]] && size=$bytes; done < "$out.dd"
if [ "$copied" = 0 ] && [ -n "$size" ] && [ "$size" -le "$cap" ]; then
    kept=1
else
    # Longer than CAP; or no room to keep it (dd counted its bytes, then failed: not tried again);
    # or a dd that could not run (no count)
    no_room=0
    [ "$copied" != 0 ] && [ -n "$size" ] && no_room=1
    size=$(stat -c %s "$out" 2>/dev/null || echo 0)
    [ "$no_room" = 1 ] || { shown > "$res" 2> /dev/null && kept=1; }
fi
end_watchdog
counters
pids_exhausted=$bomb_before
if [ -e "$out.pids" ] || [ "$pids" -gt "$pids_before" ]; then
    pids_exhausted=1
    reap all
    [ "$timed_out" = 1 ] || rc=137
    counters
fi
printf '%s\n' "$pids" > "$resdir/pids.seen"  # for the next command (see bomb_before)
oom_killed=0
[ "$oom" -gt "$oom_before" ] && oom_killed=1
printf -v trailer '\n%s %d %d %d %d %d\n' "$nonce" "$rc" "$timed_out" "$oom_killed" "$size" "$pids_exhausted"
# Results and cancel marks older than 10 min are removed by one command in 32, those whose (random)
# tag starts with 00 to 07: a find costs 2-3 ms, a sixth of the runner's time for a quick command
case $tag in
0[0-7]*) find "$resdir" \( -name '*.result' -o -name '*.cancel' \) -mmin +10 -delete 2>/dev/null ;;
esac
print_result() {  # a small result (most are) by bash's read and printf: cat's fork and exec take 1 ms
    local LC_ALL=C text=  # lengths in bytes
    if [ "$size" -le 16384 ]; then
        IFS= read -r -d '' text < "$res"
        # shorter when the output holds a NUL byte, where read stops, or was cut to CAP bytes
        [ "${#text}" = $((size + ${#trailer})) ] && printf %s "$text" && exit 0
    fi
    exec cat "$res"
}
if [ "$kept" = 1 ] && printf %s "$trailer" >> "$res" 2> /dev/null; then
    remove_files < /dev/null > /dev/null 2>&1 &  # off the caller's path (1 ms): the names are the tag's
    print_result
fi
rm -f "$res"  # no room to keep it (a diff of hundreds of MiB): printed only
shown
printf %s "$trailer"
remove_files
