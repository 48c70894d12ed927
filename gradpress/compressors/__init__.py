"""One module per family of methods. A module registers its methods when it is imported, which happens
when one of them is first made: importing this package reads (does not import) the modules' register
decorators, ``@register("name")`` and ``@feedback_registry.register("name")`` at the start of a line, and
declares each name with its module, so that ``gradpress.compressor_names()`` lists every method while
``import gradpress`` imports none of them (nor numba, scipy, … through them). tests/test_import.py checks
that what is read is what the modules register."""
import re
from pathlib import Path

from gradpress.core.compressor import registry
from gradpress.core.feedback import feedback_registry

_DECORATOR = re.compile(r"^@(\w+(?:\.\w+)*)\(\s*[\"']([^\"']+)[\"']\s*\)", re.M)
_COMPRESSOR = ("register", "register_compressor", "gradpress.register_compressor", "compressor.register")


def declared() -> tuple[dict[str, str], dict[str, str]]:
    """(compressor name -> module, feedback memory name -> module) of this package's modules, from their
    source text."""
    methods: dict[str, str] = {}
    feedbacks: dict[str, str] = {}
    for path in sorted(Path(__file__).parent.glob("*.py")):
        module = f"{__name__}.{path.stem}"
        for decorator, name in _DECORATOR.findall(path.read_text(encoding="utf-8")):
            if decorator in _COMPRESSOR:
                methods[name] = module
            elif decorator == "feedback_registry.register":
                feedbacks[name] = module
    return methods, feedbacks


_methods, _feedbacks = declared()
registry.declare(_methods)
feedback_registry.declare(_feedbacks)
