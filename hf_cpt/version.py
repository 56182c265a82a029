"""The package version (one home, read by the package and by exports)."""

__version__ = "0.1.0"

# Where the project is installed from. "hf-cpt" is not a published name on the package index, so the
# model cards and the README point to the repository (a placeholder until the project is published).
PROJECT_URL = "https://github.com/hf-cpt/hf_cpt"
INSTALL_COMMAND = f'pip install "hf-cpt @ git+{PROJECT_URL}"'
