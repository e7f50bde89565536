#!/bin/sh
# Install the Debian packages the multi-node test bed needs (tests/multinode), only when
# one is missing and only when we are root with apt-get (bounded: at most ~4 minutes when the
# network hangs; 17 s measured from a warm apt cache). Never fails: without them the
# multi-node tests skip and say why. Fast (a few dpkg queries) when everything is there.
PKGS="openssh-server openssh-client pdsh openmpi-bin iproute2"
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "multinode test bed: missing Debian packages:$missing (needs root and apt-get; the tests will skip)" >&2
    exit 0
fi
echo "multinode test bed: installing$missing" >&2
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d 101: the package scripts must not start a system sshd; the tests run their own.
created_policy=""
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && created_policy=1
fi
ok=0
timeout 90 apt-get install -y -q --no-install-recommends $missing >/tmp/ds_multinode_apt.log 2>&1 && ok=1
if [ "$ok" = 0 ]; then
    timeout 45 apt-get update -q >>/tmp/ds_multinode_apt.log 2>&1 &&
    timeout 90 apt-get install -y -q --no-install-recommends $missing >>/tmp/ds_multinode_apt.log 2>&1 && ok=1
fi
[ -n "$created_policy" ] && rm -f /usr/sbin/policy-rc.d
[ "$ok" = 1 ] || echo "multinode test bed: apt-get install failed (see /tmp/ds_multinode_apt.log); the tests will skip" >&2
exit 0
