"""Progress bars: a widget in Jupyter when ipywidgets is installed, else the console bar --
without tqdm's "IProgress not found" warning at import in a kernel that lacks ipywidgets
(the console bar it falls back to works there)."""
import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="IProgress not found")
    from tqdm.auto import tqdm

__all__ = ["tqdm"]
