#!/usr/bin/env bash
# Run "$@" with a Docker engine and the agentrl base image available, as `make test` needs.
#
# As root on a machine without a running engine (CI), this installs docker.io (and bubblewrap,
# debootstrap and chromium, for the replay page's browser test) when missing, starts dockerd,
# builds the base image when missing, exports AGENTRL_REQUIRE_DOCKER=1 so that the Docker tests
# fail rather than skip, runs the command, and stops the dockerd it started. Elsewhere (a laptop without Docker) it runs the command as is and
# the Docker tests skip with the reason.
set -u
PYTHON=${PYTHON:-.venv/bin/python}
started=""

install() {
    apt-get install -y -q "$@" > /tmp/agentrl-apt.log 2>&1 ||
        { apt-get update -q >> /tmp/agentrl-apt.log 2>&1 && apt-get install -y -q "$@" >> /tmp/agentrl-apt.log 2>&1; }
}

if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    missing=()
    command -v dockerd > /dev/null || missing+=(docker.io)
    command -v bwrap > /dev/null || missing+=(bubblewrap)
    command -v debootstrap > /dev/null || missing+=(debootstrap)
    command -v chromium > /dev/null || missing+=(chromium)  # the replay page's browser test
    if [ ${#missing[@]} -gt 0 ]; then
        echo "with_docker: installing ${missing[*]}"
        install "${missing[@]}" || { echo "with_docker: apt-get install failed, see /tmp/agentrl-apt.log"; exit 1; }
    fi
fi

if ! docker info > /dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v dockerd > /dev/null; then
    echo "with_docker: starting dockerd (log: /tmp/agentrl-dockerd.log)"
    dockerd > /tmp/agentrl-dockerd.log 2>&1 &
    started=$!
    for _ in $(seq 1 60); do docker info > /dev/null 2>&1 && break; sleep 0.5; done
fi

# The browser test fails, rather than skips, where a browser was to be installed.
command -v chromium > /dev/null && export AGENTRL_REQUIRE_BROWSER=1

if docker info > /dev/null 2>&1; then
    export AGENTRL_REQUIRE_DOCKER=1
    "$PYTHON" -m agentrl.cli sandbox build || { echo "with_docker: building the base image failed"; exit 1; }
else
    echo "with_docker: no Docker engine here; the Docker tests will skip (agentrl sandbox doctor says why)"
fi

"$@"
rc=$?
if [ -n "$started" ]; then
    echo "with_docker: stopping the dockerd it started"
    kill "$started" 2> /dev/null
    wait "$started" 2> /dev/null
fi
exit $rc
