"""Built-in tools, written with the public API only."""


def __getattr__(name):
    from amanda.runtime.backends import load
    try:
        return load(f"amanda.tools.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"amanda.tools.{name}":
            raise AttributeError(f"module 'amanda.tools' has no attribute {name!r}") from None
        raise
