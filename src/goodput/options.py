"""The config groups' options with their one-line descriptions: what `--help` lists.

An option is a file `<group>/<option>.yaml` in the config directory (conf/); its description is the
first line of its header comment (a `# @package` line skipped). `base`, the schema every option
starts from, lives in Hydra's ConfigStore (goodput.config.register), not in a file, so it is no
option. conf/hydra/default.yaml puts the list into Hydra's help template as `${goodput.options:}`.
"""

from __future__ import annotations

import os


def description(path: str) -> str | None:
    """The first line of the file's header comment, or None when the file starts with no comment."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line.startswith("# @package"):
                continue
            if not line.startswith("#"):
                return None
            return line.lstrip("#").strip() or None
    return None


def groups(conf_dir: str) -> dict[str, dict[str, str | None]]:
    """group -> option -> description, for every option file under `conf_dir` (the primary config,
    a file at the top, is no group's option)."""
    out: dict[str, dict[str, str | None]] = {}
    for d, _, files in sorted(os.walk(conf_dir)):
        group = os.path.relpath(d, conf_dir).replace(os.sep, "/")
        options = {
            f[: -len(".yaml")]: description(os.path.join(d, f)) for f in sorted(files) if f.endswith(".yaml")
        }
        if group != "." and options:
            out[group] = options
    return out


def listing(_root_) -> str:
    """The help text's list (an OmegaConf resolver: `_root_` is the composed config with `hydra`).
    Each group on one line with its options and the selected one, then an option per line with its
    description. `$` is doubled: Hydra hands the text to string.Template."""
    runtime = _root_.hydra.runtime
    dirs = [s.path for s in runtime.config_sources if s.schema == "file"]
    lines = []
    for conf_dir in dirs:
        for group, options in groups(conf_dir).items():
            chosen = runtime.choices.get(group)
            lines.append(f"{group}: {', '.join(options)}" + (f"  (selected: {chosen})" if chosen else ""))
            width = max(map(len, options))
            lines += [f"    {o:<{width}}  {text or ''}".rstrip() for o, text in options.items()]
    return "\n".join(lines).replace("$", "$$")
