"""Parse engine command lines with vLLM's own argument parser (run with .venv-vllm's python).

Reads a JSON list of argv lists on stdin, each either ``["serve", MODEL, ...]`` (the
``vllm serve`` CLI) or the arguments of ``python -m vllm.entrypoints.openai.api_server``.
Writes one JSON object per argv: ``{"ok": true, "model": ..., "kv_transfer_config": {...}}``
or ``{"ok": false, "error": ...}``. No model is loaded and nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from typing import Any


def _parse(argv: list[str]) -> dict[str, Any]:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if argv[:1] == ["serve"]:  # `vllm serve MODEL ...`, as vllm/entrypoints/cli/main.py builds it
        parser = FlexibleArgumentParser(prog="vllm")
        ServeSubcommand().subparser_init(parser.add_subparsers(dest="subcommand"))
    else:  # `python -m vllm.entrypoints.openai.api_server ...`
        parser = make_arg_parser(FlexibleArgumentParser(prog="api_server"))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
    except SystemExit:  # argparse printed the usage, then "prog: error: ..."
        lines = err.getvalue().strip().splitlines()
        first = next((i for i, line in enumerate(lines) if ": error: " in line), 0)
        return {"ok": False, "error": "\n".join(lines[first:])}
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    validate_parsed_serve_args(args)
    kv = args.kv_transfer_config
    return {
        "ok": True,
        "model": args.model,
        "host": args.host,
        "port": args.port,
        "kv_transfer_config": None
        if kv is None
        else {
            "kv_connector": kv.kv_connector,
            "kv_connector_module_path": kv.kv_connector_module_path,
            "kv_role": kv.kv_role,
            "kv_connector_extra_config": kv.kv_connector_extra_config,
        },
    }


def main() -> None:
    results = []
    for argv in json.load(sys.stdin):
        try:
            results.append(_parse(argv))
        except Exception as e:  # a validation error of vLLM's: report it, go on
            results.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
