#!/usr/bin/env bash
# Installs what rewind needs on a Debian 12 host: Debian packages, and a CRIU >= 4.
#
# Idempotent and quiet when there is nothing to do. Needs root (apt-get).
#
# CRIU: if `criu` (REWIND_CRIU, then the project prefix, then PATH) reports a
# version >= 4 and `criu check` passes, it is used as it is. Otherwise CRIU
# 4.1.1 is built from Debian trixie's *source* package into a project-owned
# prefix ($REWIND_CRIU_PREFIX, default /opt/rewind/criu). The system's apt
# configuration is never changed: the trixie deb-src line lives in a private
# sources file used only through -o Dir::Etc::SourceList=… for the source
# download. No trixie binary package is ever installed.
set -euo pipefail

CRIU_VERSION=4.1.1
CRIU_DEB_VERSION=4.1.1-1
CRIU_ORIG_SHA256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
# Bumped whenever rewind's patches to CRIU change: a project-prefix CRIU with
# another stamp is rebuilt.
CRIU_BUILD_STAMP=4.1.1-rewind3
PREFIX=${REWIND_CRIU_PREFIX:-/opt/rewind/criu}
WORK=${REWIND_DEPS_WORK:-/var/cache/rewind-deps}

# Debian packages the project needs at run time and in its tests.
APT_PACKAGES="fuse3 fuse-overlayfs xfsprogs btrfs-progs iproute2 python3 python3-venv util-linux procps psmisc attr kmod wabt"
# Build dependencies of CRIU, from bookworm.
# CRIU is built without GnuTLS (TLS for its page server) and nftables
# (network locking): rewind uses neither (its dumps skip the network lock),
# and the two pull in 14 shared libraries whose loading and constructors
# cost criu 5 ms at every start (8.4 → 3.4 ms for `criu --version`; every
# dump, restore and fork child starts one). It is linked statically (the
# -dev packages ship the .a archives): no loader, no relocations of its
# libraries, nothing loaded from the sandbox it runs in (3.5 → 1.4 ms of
# CPU for `criu --version`; a first fork of 16 children 1050-1160 →
# 925-1004 ms). glibc warns about getaddrinfo and dlopen in a static
# program: rewind uses no page server (addresses) and gives criu an empty
# --libdir (no plugins).
CRIU_BUILD_DEPS="build-essential libbsd-dev libcap-dev libnet1-dev libnl-3-dev libprotobuf-c-dev libprotobuf-dev pkgconf protobuf-c-compiler protobuf-compiler uuid-dev python3-protobuf xz-utils dpkg-dev"

log() { echo "deps: $*" >&2; }
die() { echo "deps: error: $*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "must run as root (it installs Debian packages); try: sudo make deps"

apt_updated=0
apt_update() {
	if [[ $apt_updated -eq 0 ]]; then
		log "apt-get update"
		apt-get update -qq >/dev/null
		apt_updated=1
	fi
}

# missing_packages PKG... prints the packages that are not installed.
missing_packages() {
	local p missing=()
	for p in "$@"; do
		if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
			missing+=("$p")
		fi
	done
	echo "${missing[@]:-}"
}

install_packages() {
	local missing
	missing=$(missing_packages "$@")
	[[ -z $missing ]] && return 0
	apt_update
	log "installing: $missing"
	# shellcheck disable=SC2086
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
}

# criu_ok BIN succeeds when BIN is a CRIU >= 4 whose `criu check` passes.
criu_ok() {
	local bin=$1 ver major
	[[ -x $bin ]] || return 1
	ver=$("$bin" --version 2>/dev/null | sed -n 's/^Version: *//p' | head -1)
	major=${ver%%.*}
	[[ -n $major && $major =~ ^[0-9]+$ && $major -ge 4 ]] || return 1
	"$bin" check >/dev/null 2>&1
}

find_criu() {
	local c
	if [[ -n ${REWIND_CRIU:-} ]] && criu_ok "$REWIND_CRIU"; then
		echo "$REWIND_CRIU"; return 0
	fi
	if [[ $(cat "$PREFIX/BUILD_STAMP" 2>/dev/null) == "$CRIU_BUILD_STAMP" ]] && criu_ok "$PREFIX/sbin/criu"; then
		echo "$PREFIX/sbin/criu"; return 0
	fi
	c=$(command -v criu 2>/dev/null || true)
	[[ -n $c && $c != "$PREFIX/sbin/criu" ]] && criu_ok "$c" && { echo "$c"; return 0; }
	return 1
}

# patch_criu DIR applies rewind's fixes to the CRIU source tree in DIR.
#
# 1. Linux 6.x answers getsockopt(SO_PASSCRED / SO_PASSSEC) on AF_INET and
#    AF_INET6 sockets with EOPNOTSUPP; CRIU 4.1.1 treats that as fatal, so no
#    process holding a TCP or UDP socket (a dev server, pip) could be dumped.
#    The options cannot be set on such sockets either: dump them as "off".
# 2. See below. Each patch is applied once.
patch_criu() {
	local f="$1/criu/sockets.c"
	grep -q rewind_dump_opt_optional "$f" || python3 - "$f" <<'PY' || return 1
import sys
p = sys.argv[1]
s = open(p).read()
helper = """/* rewind: EOPNOTSUPP (options that do not apply to this family) reads as off. */
static int rewind_dump_opt_optional(int sk, int level, int name, int *val)
{
	socklen_t aux = sizeof(*val);

	if (getsockopt(sk, level, name, val, &aux) < 0) {
		if (errno == EOPNOTSUPP) {
			*val = 0;
			return 0;
		}
		pr_perror("Can't get %d:%d opt", level, name);
		return -1;
	}
	return 0;
}

int dump_socket_opts(int sk, SkOptsEntry *soe)
"""
n = 0
for opt in ("SO_PASSCRED", "SO_PASSSEC"):
    old = "ret |= dump_opt(sk, SOL_SOCKET, %s, &val);" % opt
    new = "ret |= rewind_dump_opt_optional(sk, SOL_SOCKET, %s, &val);" % opt
    n += s.count(old)
    s = s.replace(old, new)
anchor = "int dump_socket_opts(int sk, SkOptsEntry *soe)\n"
if n != 2 or s.count(anchor) != 1:
    sys.exit("patch_criu: sockets.c does not look like CRIU 4.1.1's")
s = s.replace(anchor, helper, 1)
open(p, "w").write(s)
PY
	# 2. Makefile.config links libnftables whenever pkg-config finds it;
	#    honour NO_NFTABLES=1 as it honours NO_GNUTLS=1.
	local m="$1/Makefile.config"
	grep -q NO_NFTABLES "$m" || python3 - "$m" <<'PY' || return 1
import sys
p = sys.argv[1]
s = open(p).read()
old = "ifeq ($(call pkg-config-check,libnftables),y)"
if s.count(old) != 1:
    sys.exit("patch_criu: Makefile.config does not look like CRIU 4.1.1's")
s = s.replace(old, "ifeq ($(NO_NFTABLES)x$(call pkg-config-check,libnftables),xy)")
open(p, "w").write(s)
PY
}

# debian_mirror prints the URI of the host's configured Debian archive, so the
# private deb-src line uses the same mirror as the rest of the system.
debian_mirror() {
	local uri=""
	if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
		uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
	fi
	if [[ -z $uri && -f /etc/apt/sources.list ]]; then
		uri=$(awk '$1=="deb" && $0 !~ /security/ {for (i=2;i<=NF;i++) if ($i ~ /^(https?|file):/) {print $i; exit}}' /etc/apt/sources.list)
	fi
	[[ -n $uri ]] || die "cannot find the Debian mirror in /etc/apt/sources.list{,.d/debian.sources}"
	echo "$uri"
}

build_criu() {
	install_packages $CRIU_BUILD_DEPS
	mkdir -p "$WORK/lists/partial" "$WORK/src"
	local srclist="$WORK/trixie-src.list" tarball
	echo "deb-src $(debian_mirror) trixie main" >"$srclist"
	local aptopts=(-o "Dir::Etc::SourceList=$srclist" -o "Dir::Etc::SourceParts=-" -o "Dir::State::Lists=$WORK/lists")
	tarball="$WORK/src/criu_${CRIU_VERSION}.orig.tar.xz"
	if ! echo "$CRIU_ORIG_SHA256  $tarball" | sha256sum -c --status 2>/dev/null; then
		log "downloading CRIU $CRIU_DEB_VERSION source (trixie deb-src, private sources list)"
		apt-get "${aptopts[@]}" update -qq >/dev/null 2>&1 || die "apt-get update of the private trixie deb-src list failed"
		# Exits non-zero when only the .orig tarball is served; the checksum decides.
		(cd "$WORK/src" && apt-get "${aptopts[@]}" source --download-only -qq "criu=$CRIU_DEB_VERSION" >/dev/null 2>&1) || true
		echo "$CRIU_ORIG_SHA256  $tarball" | sha256sum -c --status ||
			die "criu_${CRIU_VERSION}.orig.tar.xz missing or wrong sha256 in $WORK/src"
	fi
	log "building CRIU $CRIU_VERSION (about a minute)"
	rm -rf "$WORK/build" && mkdir -p "$WORK/build"
	tar -C "$WORK/build" -xf "$tarball"
	local dir
	dir=$(find "$WORK/build" -mindepth 1 -maxdepth 1 -type d | head -1)
	patch_criu "$dir" || die "patching CRIU failed"
	# GMONLDOPT is the last of criu/Makefile's flags for linking criu
	# itself (empty unless GMON=1): -static there leaves the parasite and
	# restorer blobs, which compel links on its own, as they are. libbsd's
	# archive needs libmd's after it.
	make -C "$dir" -j"$(nproc)" NO_GNUTLS=1 NO_NFTABLES=1 GMONLDOPT="-static -lmd -lpthread -lm" criu >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log" >&2; die "CRIU build failed; full log in $WORK/build.log"; }
	if readelf -l "$dir/criu/criu" | grep -q 'program interpreter'; then
		die "the CRIU build is not statically linked (it names a program interpreter)"
	fi
	install -D -s -m 0755 "$dir/criu/criu" "$PREFIX/sbin/criu"
	criu_ok "$PREFIX/sbin/criu" || die "built CRIU at $PREFIX/sbin/criu does not pass 'criu check' (see: $PREFIX/sbin/criu check)"
	echo "$CRIU_BUILD_STAMP" >"$PREFIX/BUILD_STAMP"
	log "CRIU $CRIU_VERSION installed at $PREFIX/sbin/criu"
}

install_packages $APT_PACKAGES
if ! find_criu >/dev/null; then
	build_criu
fi
