# Two commands on a fresh clone: `make demo` and `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-all multinode-bed upstream-tests demo bench clean

$(VPY):
	$(PY) -m venv $(VENV)

$(STAMP): $(VPY) pyproject.toml
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# `make test`: the CI suite (budget: 10 minutes on 2 quiet cores). Tests marked `slow` are the
# exhaustive variants (long parity runs, client matrices, benchmarks-as-tests): `make test-all`.
test: $(STAMP) multinode-bed
	$(VPY) -m pytest tests -x -q -p no:cacheprovider -m "not slow"

test-all: $(STAMP) multinode-bed
	$(VPY) -m pytest tests -q -p no:cacheprovider

# Debian packages of the multi-host test bed (tests/multinode: sshd, pdsh, OpenMPI), installed
# only when missing and only as root with apt-get; never fails (the tests then skip, saying why).
multinode-bed:
	-@sh tests/multinode/setup_packages.sh

# DeepSpeed's own tests/unit run against this package on CPU (not part of `make test`; takes long).
# DS_UPSTREAM_REPO=<DeepSpeed checkout or bare repo>, UPSTREAM_ARGS="--modules checkpoint/test_x.py ..."
upstream-tests: $(STAMP)
	$(VPY) tests/upstream/run_upstream.py $(UPSTREAM_ARGS)

demo: $(STAMP)
	$(VENV)/bin/deepspeed --num_procs 2 examples/train_gpt.py --deepspeed --deepspeed_config examples/ds_config.json

bench: $(STAMP)
	for b in benchmarks/*.py; do echo "== $$b"; $(VPY) $$b || exit 1; done

clean:
	rm -rf $(VENV) *.egg-info
