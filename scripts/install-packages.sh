#!/usr/bin/env bash
# Installs the Debian packages torpor needs, once: mmdebstrap (image builds),
# erofs-utils (mkfs.erofs, the read-only root image), iproute2 (network namespaces).
set -euo pipefail
need=()
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v mkfs.erofs >/dev/null || need+=(erofs-utils)
command -v ip >/dev/null || need+=(iproute2)
dpkg -s ca-certificates >/dev/null 2>&1 || need+=(ca-certificates)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi
