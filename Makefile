# The two commands of the README. Both set up .venv first (idempotent).
.PHONY: run test lint

run:
	scripts/setup.sh --vllm
	.venv/bin/feather bench --json out/bench.json --plot out/bench.png

test:
	scripts/setup.sh --vllm --sglang --ray --datasets
	.venv/bin/ruff check src tests
	.venv/bin/python -m pytest -q

lint:
	.venv/bin/ruff check src tests
