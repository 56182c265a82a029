"""The package version (one home, read by the package and by exports)."""

__version__ = "0.1.0"

# How to install the project: "hf-cpt" is not published on the package index, so the README and the model
# cards name what exists: a clone of the repository, or the wheel built from it.
WHEEL_NAME = f"hf_cpt-{__version__}-py3-none-any.whl"
INSTALL_COMMAND = "pip install ."  # in a clone of the repository
WHEEL_INSTALL_COMMAND = f"pip install dist/{WHEEL_NAME}"  # after `pip wheel --no-deps -w dist .` in the clone
INSTALL_HINT = (
    f"install hf-cpt from a clone of its repository (`{INSTALL_COMMAND}`) or from the wheel built there "
    f"(`pip wheel --no-deps -w dist .`, then `{WHEEL_INSTALL_COMMAND}`)"
)
