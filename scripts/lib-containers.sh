# Containers without a registry or systemd, for scripts/images, scripts/test-images and
# scripts/test-compose. Source it after lib.sh: `. "$REPO/scripts/lib-containers.sh"`.
#
# What these machines need (Debian bookworm, root, hybrid cgroups, no systemd):
# - Debian's podman 4.3, buildah, skopeo, docker-compose 1.29, mmdebstrap, iptables, and
#   runc and catatonit, which podman only recommends (containers_install installs the
#   missing ones, scripts/check-tools checks them);
# - a containers.conf of our own through CONTAINERS_CONF (no system file is edited):
#   `runtime = "runc"` (crun refuses the hybrid cgroup layout) and default ulimits within
#   what root may set here (podman's default asks for more nofile than the machine allows);
# - a local Debian base image (no registry is reachable or needed): containers_base_image.

KVGUARD_IMAGE_CACHE=${KVGUARD_IMAGE_CACHE:-$KVGUARD_CACHE/images}
# The local stand-in for debian:bookworm-slim (kvguard's binaries are built on bookworm).
KVGUARD_BASE_IMAGE=${KVGUARD_BASE_IMAGE:-localhost/kvguard/debian:bookworm-minbase}
# The workspace version tags the images.
KVGUARD_VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO/Cargo.toml" | head -1)
export KVGUARD_IMAGE_CACHE KVGUARD_BASE_IMAGE KVGUARD_VERSION

# containers_install: the Debian packages, only those missing (idempotent, no apt-get when
# everything is there).
containers_install() {
  local -A want=([podman]=podman [buildah]=buildah [skopeo]=skopeo
    [docker-compose]=docker-compose [mmdebstrap]=mmdebstrap [iptables]=iptables
    [jq]=jq [curl]=curl [ss]=iproute2 [runc]=runc)
  local missing=() cmd
  for cmd in "${!want[@]}"; do
    command -v "$cmd" >/dev/null 2>&1 || missing+=("${want[$cmd]}")
  done
  # podman's container init (compose's `init: true`): a Recommends of podman, so
  # --no-install-recommends leaves it out.
  [ -x /usr/libexec/podman/catatonit ] || missing+=(catatonit)
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "installing ${missing[*]} (apt-get)"
    local sudo=()
    [ "$(id -u)" = 0 ] || sudo=(sudo)
    "${sudo[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null || die "apt-get install ${missing[*]} failed"
  fi
}

# containers_conf: writes the project's containers.conf and exports CONTAINERS_CONF.
containers_conf() {
  local dir=$KVGUARD_CACHE/containers
  mkdir -p "$dir"
  cat >"$dir/containers.conf" <<'EOF'
# Written by kvguard's scripts/lib-containers.sh; used through CONTAINERS_CONF.
[containers]
# Root here may not raise limits beyond these (podman's default nofile is higher).
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
# crun refuses the machine's hybrid cgroup layout; runc runs.
runtime = "runc"
EOF
  export CONTAINERS_CONF=$dir/containers.conf
}

# containers_debian_image TAG NAME [PACKAGE,...]: makes the local image TAG unless podman
# has it: a Debian bookworm minbase root file system (mmdebstrap, about a minute once) with
# PACKAGES added, without documentation and locales (like debian:bookworm-slim). The tarball
# is cached as $KVGUARD_IMAGE_CACHE/NAME[-<hash of PACKAGES>].tar, so later runs only import
# it (seconds) and a changed package list makes a new one.
containers_debian_image() {
  local tag=$1 name=$2 include=${3:-}
  podman image exists "$tag" && return 0
  [ -z "$include" ] || name=$name-$(printf %s "$include" | sha256sum | cut -c1-12)
  local tar=$KVGUARD_IMAGE_CACHE/$name.tar
  mkdir -p "$KVGUARD_IMAGE_CACHE"
  if [ ! -s "$tar" ]; then
    echo "making $tag with mmdebstrap (once; cached in $tar)"
    mmdebstrap --variant=minbase --format=tar --quiet ${include:+--include="$include"} \
      --dpkgopt='path-exclude=/usr/share/doc/*' \
      --dpkgopt='path-exclude=/usr/share/man/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' \
      bookworm "$tar.tmp" || die "mmdebstrap bookworm failed (needs deb.debian.org)"
    mv "$tar.tmp" "$tar"
  fi
  podman import --quiet --change 'CMD ["/bin/bash"]' "$tar" "$tag" >/dev/null ||
    die "podman import $tar failed"
}

# containers_base_image: $KVGUARD_BASE_IMAGE, the stand-in for debian:bookworm-slim.
containers_base_image() {
  containers_debian_image "$KVGUARD_BASE_IMAGE" debian-bookworm-minbase
}

# containers_setup: all of the above.
containers_setup() {
  containers_install
  containers_conf
  containers_base_image
}

# The runtime libraries a host Python (e.g. pyenv's) and the vLLM virtualenv load, g++ and openssl
# (vLLM on CPU compiles its graphs with torch inductor, as the official CPU image can), on top
# of minbase: the CPU profile's stand-in image mounts both and runs vLLM from them.
KVGUARD_PYTHON_IMAGE=${KVGUARD_PYTHON_IMAGE:-localhost/kvguard/debian:bookworm-python-runtime}
export KVGUARD_PYTHON_IMAGE
containers_python_image() {
  containers_debian_image "$KVGUARD_PYTHON_IMAGE" debian-bookworm-python-runtime \
    libssl3,libffi8,libsqlite3-0,libbz2-1.0,liblzma5,libreadline8,libncursesw6,libnsl2,libuuid1,libgdbm6,libgomp1,libnuma1,g++,openssl
}
