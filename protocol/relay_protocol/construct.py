"""Building decoded dataclass instances, directly where that is the same as calling the class.

The ``__init__`` that ``@dataclass(frozen=True)`` writes sets each field with
``object.__setattr__``, one call per field; for a workflow of thirty fields
that costs ten times more than checking them. When that ``__init__`` would do
nothing else, the codec makes the instance with ``object.__new__`` and gives
it its fields in one dictionary (defaults included, in field order, as the
``__init__`` leaves them). That is the case when all of these hold, checked
once per class by :func:`direct`:

- the class itself went through ``@dataclass(frozen=True)`` (it is not merely
  a subclass of a dataclass) and kept the ``__init__`` that wrote, not one of
  its own from the class body;
- the ``__init__`` takes exactly the fields: no ``InitVar``, no ``init=False``
  field;
- there is no ``__post_init__``, no ``__new__`` and no ``__slots__`` anywhere
  in the class's bases;
- no field is a data descriptor on the class (which ``object.__setattr__``
  would call).

Any other dataclass is built by calling it with the decoded fields.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

#: Makes the instance from its decoded fields, by name.
Builder = Callable[[dict[str, Any]], Any]

# dataclasses writes its functions with exec(); a function written by hand has a file.
_GENERATED = "<string>"


class Construction(NamedTuple):
    """How a decoder builds instances of one dataclass."""

    build: Builder
    #: What the decoder fills in with the fields it finds, copied for each instance: every field
    #: in order with its default, or None to keep the place of one without or with a factory.
    #: Empty when ``build`` calls the class, whose ``__init__`` supplies the defaults.
    start: dict[str, Any]
    #: The default factories the decoder calls for the fields it did not find.
    factories: dict[str, Callable[[], Any]]


def construction(cls: type) -> Construction:
    """How to build ``cls`` from its decoded fields: directly if :func:`direct`, else by calling it."""
    if not direct(cls):
        return Construction(lambda values: cls(**values), {}, {})
    new, set_attribute = object.__new__, object.__setattr__

    def build(values: dict[str, Any]) -> Any:
        instance: Any = new(cls)
        set_attribute(instance, "__dict__", values)  # the dictionary is the decoder's own, fresh per instance
        return instance

    fields = dataclasses.fields(cls)
    # f.default is the very object the generated __init__ gives a field left out.
    start = {f.name: None if f.default is dataclasses.MISSING else f.default for f in fields}
    factories = {f.name: f.default_factory for f in fields if f.default_factory is not dataclasses.MISSING}
    return Construction(build, start, factories)


def direct(cls: type) -> bool:
    """Whether ``cls(**values)`` would only set each field on a new instance (see the module's docstring)."""
    params = cls.__dict__.get("__dataclass_params__")
    init = cls.__dict__.get("__init__")
    if params is None or not params.init or not params.frozen or not inspect.isfunction(init):
        return False
    if init.__code__.co_filename != _GENERATED or init.__qualname__ != f"{cls.__qualname__}.__init__":
        return False
    fields = dataclasses.fields(cls)
    parameters = list(inspect.signature(init).parameters)[1:]
    if sorted(parameters) != sorted(f.name for f in fields) or not all(f.init for f in fields):
        return False
    if hasattr(cls, "__post_init__"):
        return False
    if any("__new__" in vars(base) or "__slots__" in vars(base) for base in cls.__mro__ if base is not object):
        return False
    return not any(_is_data_descriptor(inspect.getattr_static(cls, f.name, None)) for f in fields)


def _is_data_descriptor(attribute: object) -> bool:
    return hasattr(type(attribute), "__set__") or hasattr(type(attribute), "__delete__")
