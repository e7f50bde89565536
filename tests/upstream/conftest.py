# The upstream driver and its plugin are not tests of this suite: `make upstream-tests` runs them.
collect_ignore = ["run_upstream.py", "upstream_plugin.py"]
