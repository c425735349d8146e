#!/bin/bash
# .ci/test on a fresh Debian, as a new user's machine has it: debootstrap SUITE (bookworm, trixie) into DIR, a clean
# clone of this repository inside, then the README's test command as root with nothing installed by hand.
#   sudo bench/debian_chroot_ci.sh bookworm /srv/deb12 [pytest args]      (REQUIRE=1: fail on any skip, as CI)
# Needs debootstrap and network access to deb.debian.org and PyPI. Results: docs/validation/2026-11-27-debian-ci/.
set -x
suite=$1 dir=$2
if [ ! -x "$dir/usr/bin/apt-get" ]; then
  debootstrap --variant=minbase --include=ca-certificates,git,python3 "$suite" "$dir" http://deb.debian.org/debian || exit 10
fi
# a Debian install as shipped has its security and point-release updates (debootstrap writes only the main suite)
cat > "$dir/etc/apt/sources.list" <<SRC
deb http://deb.debian.org/debian $suite main
deb http://deb.debian.org/debian $suite-updates main
deb http://deb.debian.org/debian-security $suite-security main
SRC
for m in proc sys dev dev/pts; do mountpoint -q "$dir/$m" || mount --bind "/$m" "$dir/$m"; done
cp /etc/resolv.conf "$dir/etc/resolv.conf"
# this build machine reaches the package registries through a TLS-inspecting proxy: its CA goes into the chroot's store
mkdir -p "$dir/usr/local/share/ca-certificates"
awk -v dir="$dir/usr/local/share/ca-certificates" '/BEGIN CERT/{n++; f=sprintf("%s/host-%03d.crt", dir, n)} {if (f) print > f}' /etc/ssl/certs/ca-certificates.crt
chroot "$dir" update-ca-certificates >/dev/null 2>&1 || cp /etc/ssl/certs/ca-certificates.crt "$dir/etc/ssl/certs/ca-certificates.crt"
rm -rf "$dir/src" && git clone -q "$(cd "$(dirname "$0")/.." && pwd)" "$dir/src"
# this launcher runs in the background, where SIGINT is ignored and a shell cannot trap it again: give .ci/test a
# default SIGINT, as a terminal or CI would (the demo test stops run-local.sh with it)
mkdir -p "$dir/usr/local/bin"
printf '%s\n' '#!/usr/bin/python3' 'import os, signal, sys' 'signal.signal(signal.SIGINT, signal.SIG_DFL)' 'os.execvp(sys.argv[1], sys.argv[1:])' > "$dir/usr/local/bin/sigint-default"
chmod +x "$dir/usr/local/bin/sigint-default"
env -i /usr/sbin/chroot "$dir" /bin/bash -c "cd /src && git log --oneline -1 && cat /etc/os-release | head -1 && python3 --version && PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root PIP_CERT=/etc/ssl/certs/ca-certificates.crt NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt CI_REQUIRE_ALL_TESTS=${REQUIRE:-} /usr/local/bin/sigint-default .ci/test $3"
echo "ci-test-rc=$?"
