# `make demo` and `make test` each work from a fresh clone: they create .venv and install what they need.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The environment is made open to read (umask 022) whatever the clone's umask: a root server's jobs
# run as uids of their own and read it through their sandbox. A clone made with umask 077 stays
# closed to the host's other users all the same: its own folder is 0700.
PIP    := umask 022 && $(PY) -m pip install --quiet --disable-pip-version-check
comma  := ,

.PHONY: demo test bench proto clean sandbox test-tools

$(PY):
	umask 022 && $(PYTHON) -m venv $(VENV)

# The server and what the demo's Keras job needs (TensorFlow on the CPU, scikit-learn's digits).
$(VENV)/.demo: pyproject.toml | $(PY)
	$(PIP) -e '.[server,tf,examples]'
	touch $@

# Everything the tests use. torch is pinned first to the CPU build (2.13.0); the `torch` extra's
# range is then already met and pip does not reach for a multi-GB CUDA build.
# tritonclient and tensorflow-serving-api come without their own pins (protobuf < 7 and the full
# tensorflow): their generated code runs on protobuf 7, and tensorflow-cpu is the tensorflow here.
$(VENV)/.dev: pyproject.toml | $(PY)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev,tf,torch]'
	$(PIP) --no-deps tritonclient==2.73.0 tensorflow-serving-api==2.21.0
	touch $@

# Debian packages installed when their command is missing and we are root (apt-get); otherwise
# said, with what then does without them. $(1): TOOL:PACKAGE pairs, $(2): what for, $(3): what happens without.
define apt_install
	@missing=""; for tool in $(1); do command -v $${tool%%:*} >/dev/null || [ -x /usr/sbin/$${tool%%:*} ] || missing="$$missing $${tool#*:}"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing$$missing ($(2))"; \
		apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq$$missing >/dev/null; \
	else \
		echo "not installed:$$missing — $(3) (sudo apt-get install$$missing)"; \
	fi
endef

# The jobs' sandbox: bubblewrap, and slirp4netns for their network's way out. Without them the
# server runs without isolation (admin tokens only).
sandbox:
	$(call apt_install,bwrap:bubblewrap slirp4netns:slirp4netns,the jobs' sandbox,jobs run without a sandbox$(comma) and tests that need other users skip)

# What some tests need beside the sandbox: sshd (tests/test_ssh.py, ssh:// routes), Chromium
# (tests/test_dashboard.py drives it with Playwright; no browser is downloaded), Prometheus
# (tests/test_metrics.py scrapes the server with it and runs the Grafana dashboard's queries) and
# Slurm with munge (tests/test_slurm.py starts a one-node cluster with them) and slurmrestd
# (tests/test_slurm_rest.py talks to the cluster through it).
test-tools:
	$(call apt_install,sshd:openssh-server chromium:chromium prometheus:prometheus slurmctld:slurm-wlm munged:munge slurmrestd:slurmrestd,for the tests,the tests that need them skip)

demo: $(VENV)/.demo sandbox
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash examples/demo.sh

test: $(VENV)/.dev sandbox test-tools
	$(PY) -m pytest

# The peers: Ray from the bench extra; rsync from Debian (sync figures are skipped without it).
$(VENV)/.bench: pyproject.toml | $(PY)
	$(PIP) -e '.[bench]'
	touch $@

bench: $(VENV)/.dev $(VENV)/.bench
	@command -v rsync >/dev/null || echo "rsync not found: the sync figures are skipped (apt-get install rsync)"
	$(PY) bench/bench_cli.py
	$(PY) bench/bench_connect.py
	$(PY) bench/bench_jobs.py
	$(PY) bench/bench_queue.py
	$(PY) bench/bench_scheduler.py
	$(PY) bench/bench_fairness.py --quick
	$(PY) bench/bench_submits.py
	$(PY) bench/bench_arrays.py
	$(PY) bench/bench_sessions.py
	$(PY) bench/bench_serving.py
	$(PY) bench/bench_isolation.py
	$(PY) bench/bench_hostile.py
	$(PY) bench/bench_ray.py
	$(PY) bench/bench_ssh.py
	$(PY) bench/bench_tf_remote.py
	$(PY) bench/bench_link.py
	$(PY) bench/bench_dashboard.py

# Regenerate the gRPC stubs after editing gpuport/protocol/gpuport.proto.
proto: $(VENV)/.dev
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. gpuport/protocol/gpuport.proto
	$(PY) -m grpc_tools.protoc -I . --include_imports --descriptor_set_out=gpuport/protocol/serving/serving.desc \
		gpuport/protocol/serving/*.proto

clean:
	rm -rf $(VENV) build *.egg-info
