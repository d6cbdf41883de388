#!/usr/bin/env bash
# Install the Debian packages KSpeed's tests and benchmarks use, when missing and possible, and
# link the distribution's pyverbs (rdma-core) into the virtual environment. PyPI's pyverbs does
# not work; the RDMA rail needs the distribution's build.
set -u
venv=${1:-.venv}
want=()
dpkg -s python3-pyverbs >/dev/null 2>&1 || want+=(python3-pyverbs)
command -v redis-server >/dev/null 2>&1 || want+=(redis-server)
command -v ip >/dev/null 2>&1 || want+=(iproute2)
# libjpeg-turbo's headers, for the region decoder (kspeed/preprocess/_jpegregion.c, built at install)
[ -f /usr/include/jpeglib.h ] || want+=(libjpeg62-turbo-dev)
if [ ${#want[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian packages: ${want[*]}"
    apt-get update -qq >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${want[@]}" >/dev/null 2>&1 \
      || echo "warning: could not install ${want[*]}; tests that need them will skip"
  else
    echo "note: install these Debian packages for the full test suite: ${want[*]} (tests that need them skip)"
  fi
fi
# promtool (Prometheus' metrics linter) from Debian's prometheus package, extracted into the venv
# rather than installed (the package would also install and start a Prometheus service).
if [ ! -x "$venv/bin/promtool" ] && ! command -v promtool >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  work=$(mktemp -d)
  fetch() { (cd "$work" && apt-get download prometheus >/dev/null 2>&1); }
  fetch || { [ "$(id -u)" = 0 ] && apt-get update -qq >/dev/null 2>&1 && fetch; }
  if ls "$work"/prometheus_*.deb >/dev/null 2>&1 && dpkg -x "$work"/prometheus_*.deb "$work/x" \
    && [ -x "$work/x/usr/bin/promtool" ]; then
    cp "$work/x/usr/bin/promtool" "$venv/bin/promtool"
  else
    echo "note: could not fetch promtool (Debian's prometheus package); the metrics lint test will skip"
  fi
  rm -rf "$work"
fi
# Make the distribution's pyverbs importable from the venv (a .pth line, not a copy).
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -d /usr/lib/python3/dist-packages/pyverbs ]; then
  mkdir -p "$site/kspeed_pyverbs"
  ln -sfn /usr/lib/python3/dist-packages/pyverbs "$site/kspeed_pyverbs/pyverbs"
  echo "$site/kspeed_pyverbs" > "$site/kspeed-pyverbs.pth"
fi
exit 0
