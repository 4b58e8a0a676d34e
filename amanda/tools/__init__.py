"""Built-in tools, written with the public API only."""


def __getattr__(name):
    import importlib
    try:
        return importlib.import_module(f"amanda.tools.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"amanda.tools.{name}":
            raise AttributeError(f"module 'amanda.tools' has no attribute {name!r}") from None
        raise
