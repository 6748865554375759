"""What a saved `.mlpackage` says about its functions, read from its spec with no native work.

A one-function package describes its `main` function in the model description itself; a
multifunction package (a layer package with its prefill function) lists each function in
`description.functions`, names a default, and leaves the top-level inputs empty. The compiler's
static checks and the runtime's Core ML loader both read packages through this.
"""

from __future__ import annotations

from typing import Any

from ane_spec.errors import AneSpecError

DEFAULT_FUNCTION = "main"


def package_functions(spec: Any) -> list[str]:
    """The functions a package holds, its default first."""
    desc = spec.description
    if not desc.functions:
        return [DEFAULT_FUNCTION]
    names = [f.name for f in desc.functions]
    default = desc.defaultFunctionName or names[0]
    return [default, *(n for n in names if n != default)]


def is_multifunction(spec: Any) -> bool:
    return bool(spec.description.functions)


def function_description(spec: Any, function: str = DEFAULT_FUNCTION) -> Any:
    """One function's inputs, outputs and states (a FunctionDescription, or the model
    description of a one-function package's `main`)."""
    desc = spec.description
    if not desc.functions:
        if function != DEFAULT_FUNCTION:
            raise AneSpecError(f"the package has no function '{function}' (only "
                               f"{DEFAULT_FUNCTION})")
        return desc
    for fdesc in desc.functions:
        if fdesc.name == function:
            return fdesc
    raise AneSpecError(f"the package has no function '{function}' (it has "
                       f"{', '.join(f.name for f in desc.functions)})")


def read_spec(package: Any) -> Any:
    """The package's Model spec (protobuf only: coremltools' MLModel with skip_model_load)."""
    import coremltools as ct

    return ct.models.MLModel(str(package), skip_model_load=True).get_spec()
