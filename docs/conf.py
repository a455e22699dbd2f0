"""Sphinx configuration: `make docs` builds docs/_build/html with warnings as errors.

No network at build time: no intersphinx; JAX, Flax, optax and orbax are linked by URL.
The notebooks under docs/notebooks/ are executed copies (docs/execute_notebooks.py),
rendered from their stored outputs.
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # importing for autodoc starts no accelerator probe

import dtensor  # noqa: E402
import dtensor.checkpoint  # noqa: E402
import strategies  # noqa: E402
import strategies.failure_handling  # noqa: E402
import strategies.tf_compat  # noqa: E402

# sphinx-autodoc-typehints calls an API Sphinx 10 removes: its notice is not ours to fix.
warnings.filterwarnings("ignore", message=".*set_application.*is deprecated")

project = "jax-dtensor"
author = "jax-dtensor authors"
copyright = "2026, jax-dtensor authors"  # noqa: A001
release = dtensor.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx_autodoc_typehints",
    "myst_nb",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]
root_doc = "index"

# --------------------------------------------------------------- notebooks
nb_execution_mode = "off"  # docs/notebooks/*.ipynb carry their outputs
nb_merge_streams = True
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# ----------------------------------------------------------------- autodoc
autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "description"
autodoc_class_signature = "separated"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
typehints_fully_qualified = False
always_document_param_types = False
typehints_document_rtype = True
# Forward references under `if TYPE_CHECKING:` stay as written instead of failing the build.
suppress_warnings = [
    "sphinx_autodoc_typehints.forward_reference",
    "sphinx_autodoc_typehints.guarded_import",
]

# ------------------------------------------------------------------- theme
html_theme = "sphinx_book_theme"
html_title = "jax-dtensor"
html_static_path = ["_static"]
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
html_last_updated_fmt = None


# --------------------------------------------- public paths for cross-references
def _public_names() -> dict[str, str]:
    """'dtensor.core.layout.Layout' -> 'dtensor.Layout' for every public name."""
    out: dict[str, str] = {}
    for package in (dtensor, dtensor.checkpoint, strategies, strategies.failure_handling):
        for name in getattr(package, "__all__", []):
            obj = getattr(package, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                out.setdefault(f"{obj.__module__}.{obj.__qualname__}", f"{package.__name__}.{name}")
    return out


PUBLIC = _public_names()


def _missing_reference(app, env, node, contnode):  # type: ignore[no-untyped-def]
    """A type hint names `dtensor.core.mesh.Mesh`; the page documents it as `dtensor.Mesh`."""
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    public = PUBLIC.get(target)
    if public is None:
        head, _, attr = target.rpartition(".")
        if head in PUBLIC:
            public = f"{PUBLIC[head]}.{attr}"
    if public is None:
        return _external_reference(node, contnode)
    domain = env.domains["py"]
    for role in ("class", "func", "exc", "meth", "attr", "obj"):
        found = domain.resolve_xref(env, node["refdoc"], app.builder, role, public, node, contnode)
        if found is not None:
            return found
    return None


EXTERNAL = {  # no intersphinx (no network at build time): link out by URL
    "jax.sharding.": "https://docs.jax.dev/en/latest/jax.sharding.html#{target}",
    "jax.": "https://docs.jax.dev/en/latest/_autosummary/{target}.html",
    "flax.": "https://flax.readthedocs.io/en/latest/",
    "optax.": "https://optax.readthedocs.io/en/latest/",
    "orbax.": "https://orbax.readthedocs.io/en/latest/",
    "numpy.": "https://numpy.org/doc/stable/",
}


# Where JAX's classes are defined -> where JAX documents them.
EXTERNAL_ALIASES = {
    "jax.jaxlib._jax.Array": "jax.Array",
    "jaxlib._jax.Array": "jax.Array",
    "jax._src.mesh.Mesh": "jax.sharding.Mesh",
    "jax._src.named_sharding.NamedSharding": "jax.sharding.NamedSharding",
    "jax._src.partition_spec.PartitionSpec": "jax.sharding.PartitionSpec",
    "jax.P": "jax.sharding.PartitionSpec",
    "jax._src.api.ShapeDtypeStruct": "jax.ShapeDtypeStruct",
}


def _external_reference(node, contnode):  # type: ignore[no-untyped-def]
    from docutils import nodes

    target = node.get("reftarget", "")
    target = EXTERNAL_ALIASES.get(target, target)
    if target.startswith("jax") and "._" in target:  # private: JAX documents it elsewhere or not
        return None
    for prefix, url in EXTERNAL.items():
        if target.startswith(prefix):
            ref = nodes.reference("", "", internal=False, refuri=url.format(target=target))
            ref += contnode
            return ref
    return None


def _remaining_public_names_directive():  # type: ignore[no-untyped-def]
    """``.. remaining-public-names:: strategies``: autodoc for each name in the module's
    ``__all__`` that the page does not document by name yet, so a name added to
    ``__all__`` is in the reference before it is given its place in a topic."""
    import importlib

    from docutils import nodes
    from docutils.parsers.rst import directives
    from docutils.statemachine import StringList
    from sphinx.util.docutils import SphinxDirective

    class RemainingPublicNames(SphinxDirective):
        required_arguments = 1
        option_spec = {"exclude": directives.unchanged}

        def run(self):  # type: ignore[no-untyped-def]
            module = importlib.import_module(self.arguments[0])
            source = Path(self.env.doc2path(self.env.docname)).read_text()
            exclude = {n.strip() for n in self.options.get("exclude", "").split(",") if n.strip()}
            lines: list[str] = []
            for name in module.__all__:
                qualified = f"{module.__name__}.{name}"
                obj = getattr(module, name)
                if name in exclude or inspect.ismodule(obj) or f":: {qualified}\n" in source:
                    continue
                if inspect.isclass(obj) and issubclass(obj, BaseException):
                    lines += [f".. autoexception:: {qualified}", ""]
                elif inspect.isclass(obj):
                    lines += [f".. autoclass:: {qualified}", "   :members:", ""]
                elif callable(obj):
                    lines += [f".. autofunction:: {qualified}", ""]
                else:
                    lines += [f".. autodata:: {qualified}", ""]
            if not lines:
                return []
            container = nodes.container()
            container += nodes.rubric(text="More public names")
            self.state.nested_parse(StringList(lines, source=self.env.docname), 0, container)
            return [container]

    return RemainingPublicNames


def setup(app):  # type: ignore[no-untyped-def]
    app.connect("missing-reference", _missing_reference)
    app.add_directive("remaining-public-names", _remaining_public_names_directive())
