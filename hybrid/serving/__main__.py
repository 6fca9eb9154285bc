"""`python -m hybrid.serving --artifact DIR --requests FILE.jsonl [--out SCORES.jsonl]` (see `_cli`)."""

from hybrid.serving._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
