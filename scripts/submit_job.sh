#!/usr/bin/env bash
# Submit the rollout service to a Ray cluster as a job (see docs/service.md). The job's entrypoint,
# `rollout serve`, starts the named service actors and keeps them alive until `ray job stop`.
#
#   scripts/submit_job.sh [CONFIG [extra `rollout serve` flags...]]      CONFIG: configs/cluster.toml, a path
#   relative to the repository root (the job runs in an uploaded copy of it)
#
#   RAY_ADDRESS    the head node's dashboard (default http://127.0.0.1:8265)
#   JOB_ID         the submission id (default rollout-service)
#   RAY_AUTH_MODE  token (default; the token comes from ~/.ray/auth_token or RAY_AUTH_TOKEN), or disabled
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,10p' "$0" | cut -c3-
    exit 0
fi
cd "$(dirname "$0")/.."
config="${1:-configs/cluster.toml}"
shift $(( $# > 0 ? 1 : 0 ))
if [[ "$(realpath -m -- "$config")" != "$(pwd)"/* ]]; then  # the job gets a copy of the repository, nothing else
    echo "submit_job.sh: config file '$config' is outside the repository $(pwd), which is all the job gets a copy of" >&2
    exit 2
fi
if [[ ! -f "$config" ]]; then  # the job reads it from the uploaded repository: a path relative to the root
    echo "submit_job.sh: config file '$config' not found in $(pwd) (a CONFIG path is relative to the repository root)" >&2
    exit 2
fi
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
address="${RAY_ADDRESS:-http://127.0.0.1:8265}"
job="${JOB_ID:-rollout-service}"
ray job submit --address "$address" --submission-id "$job" --working-dir . --no-wait \
    -- rollout serve --config "$config" "$@"
echo "follow: ray job logs --address $address --follow $job"
echo "stop:   ray job stop --address $address $job"
