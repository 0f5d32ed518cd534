#!/usr/bin/env bash
# A local CA and one certificate per specd service, for trying mutual TLS (not for production).
#
#   scripts/dev-certs.sh [OUT_DIR] [NAME...]      # default: ./certs, names draft target gateway client
#
# OUT_DIR/ca.crt (+ ca.key) and, for each NAME, NAME.crt and NAME.key. Every certificate is valid
# for both ends of a connection (serverAuth and clientAuth), with subject alternative names NAME,
# localhost, 127.0.0.1 and ::1, and the in-cluster names draft, target and gateway (so one set of
# files works for `specd serve`-style loopback runs, compose and the Kubernetes overlay). Run it
# again with another OUT_DIR to get a second, unrelated CA.
set -euo pipefail

out=${1:-certs}
shift || true
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(draft target gateway client)
days=${SPECD_CERT_DAYS:-365}

mkdir -p "$out"
umask 077
if [ ! -f "$out/ca.key" ]; then
  openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days "$days" \
    -keyout "$out/ca.key" -out "$out/ca.crt" -subj "/CN=specd dev CA $(date +%s)-$RANDOM" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi
for name in "${names[@]}"; do
  ext=$(mktemp)
  cat > "$ext" <<EXT
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=DNS:$name,DNS:localhost,IP:127.0.0.1,IP:::1,DNS:draft,DNS:target,DNS:gateway
EXT
  openssl req -newkey rsa:2048 -nodes -sha256 -keyout "$out/$name.key" -out "$out/$name.csr" \
    -subj "/CN=$name" 2>/dev/null
  openssl x509 -req -in "$out/$name.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" -CAcreateserial \
    -days "$days" -sha256 -extfile "$ext" -out "$out/$name.crt" 2>/dev/null
  rm -f "$out/$name.csr" "$ext"
done
chmod 644 "$out"/*.crt
echo "wrote $out/ca.crt and ${names[*]} (.crt/.key) in $out"
