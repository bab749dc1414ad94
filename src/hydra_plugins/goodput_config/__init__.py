"""goodput's config schemas and resolvers, registered where Hydra always looks.

Hydra imports every module under the `hydra_plugins` namespace package while it discovers plugins,
which it does before it composes any config: in scripts/train.py, for `--help`, and under
`hydra.initialize_config_dir` + `compose` in a notebook or a test that imported nothing of goodput.
So importing this module is what makes the option files' `defaults: [base]` (and the resolvers the
config files use) resolvable everywhere. What is registered: goodput.config.register. The import
is cheap (no torch, no mlflow), since every Hydra start pays for it.
"""

from goodput.config import register

register()
