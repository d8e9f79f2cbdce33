#!/usr/bin/env bash
# Installs the Debian packages torpor needs, once: mmdebstrap (image builds),
# erofs-utils (mkfs.erofs, the read-only root image), iproute2 (network namespaces),
# Node.js and npm (the E2B SDK tests, e2e/e2bsdk), PostgreSQL (the metadata store's
# PostgreSQL tests start private clusters with its initdb and postgres, as its system
# user postgres; Debian's package also makes a cluster "main" of its own, which torpor
# does not use).
# With --proto (what `make proto` runs), also protoc and its well-known types, which
# regenerating api/e2b/envd/gen needs; building and testing do not.
set -euo pipefail
need=()
if [ "${1:-}" = "--proto" ]; then
  command -v protoc >/dev/null || need+=(protobuf-compiler)
  [ -f /usr/include/google/protobuf/timestamp.proto ] || need+=(libprotobuf-dev)
fi
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v mkfs.erofs >/dev/null || need+=(erofs-utils)
command -v ip >/dev/null || need+=(iproute2)
dpkg -s ca-certificates >/dev/null 2>&1 || need+=(ca-certificates)
command -v node >/dev/null || need+=(nodejs)
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || need+=(postgresql)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi
# Debian's nodejs comes without npm; NodeSource's includes it.
if ! command -v npm >/dev/null; then
  echo "installing npm"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null
fi
