"""`python -m hybrid.serving --artifact DIR --requests FILE.jsonl [--out SCORES.jsonl]`, or
`python -m hybrid.serving serve --artifact DIR --port N` (see `_cli`, `_server`)."""

from hybrid.serving._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
