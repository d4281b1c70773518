# Source on the device (no network, no pip install): a copy of the package with quantkit.kernels and
# quantkit.calib_data in place, importable through PYTHONPATH.
rm -rf /tmp/qk && mkdir -p /tmp/qk && cp -r quantkit /tmp/qk/ && cp -r kernels /tmp/qk/quantkit/kernels \
  && cp -r calib_data /tmp/qk/quantkit/calib_data && export PYTHONPATH=/tmp/qk:$PWD PYTHONUNBUFFERED=1
