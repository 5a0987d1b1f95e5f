"""The ``dpd`` subcommands of the cluster side: ``render`` and ``crd`` (I/O around pure functions)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from dpd.config import ConfigError, parse_config
from dpd.k8s.autoscaling import RenderError, adapter_rules
from dpd.k8s.crd import crd
from dpd.k8s.render import DPD_IMAGE, RenderOptions, config_document, render, to_yaml

ADAPTER_RULES_FILE = "prometheus-adapter-rules.yaml"


def read_document(path: str) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(path, [f"(file): cannot read: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError(path, [f"(yaml): {exc}"]) from None
    return data if data is not None else {}


def object_file_name(index: int, obj: dict) -> str:
    return f"{index:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def render_command(args: argparse.Namespace) -> int:
    options = RenderOptions(dpd_image=args.dpd_image or DPD_IMAGE, worker_image=args.worker_image)
    try:
        document = read_document(args.file)
        objects = render(document, options, source=args.file)
    except RenderError as exc:
        print(f"dpd render: {args.file}: {exc}", file=sys.stderr)
        return 2
    from dpd.cli import warn_not_applied

    warn_not_applied(parse_config(config_document(document), args.file), "dpd render")
    if not args.out:
        sys.stdout.write(to_yaml(objects))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for index, obj in enumerate(objects):
        (out / object_file_name(index, obj)).write_text(to_yaml([obj]))
    # Not an object: the rules to merge into the Prometheus adapter's own config.
    (out / ADAPTER_RULES_FILE).write_text(yaml.safe_dump(adapter_rules(), sort_keys=False))
    print(f"{len(objects)} objects written to {out} (and {ADAPTER_RULES_FILE})")
    return 0


def crd_command(args: argparse.Namespace) -> int:
    if args.operator:
        from dpd.k8s.install import operator_manifests

        sys.stdout.write(to_yaml(operator_manifests(args.namespace, args.dpd_image or DPD_IMAGE, args.watch_namespace)))
    else:
        sys.stdout.write(to_yaml([crd()]))
    return 0
