# The course: nbgrader labs built from solutions/ (included by the main Makefile, which defines VENV, PY, STAMP).
#
#   make labs   solutions/labNN/labNN.py -> solutions/labNN/labNN.ipynb -> labs/labNN/labNN.ipynb
#               (jupytext source -> nbgrader source notebook -> `nbgrader generate_assignment labNN --force`,
#               run from the repository root so nbgrader reads nbgrader_config.py)
#   make lab    JupyterLab on labs/ (start with labs/README.md); LAB_ARGS adds server flags, e.g.
#               make lab LAB_ARGS="--no-browser --ip 0.0.0.0 --port 8888"

LAB_ARGS ?= --no-browser

.PHONY: labs lab

labs: $(STAMP)  ## rebuild solutions/*.ipynb and the released labs/ from solutions/labNN/labNN.py
	$(PY) tools/build_notebooks.py --release

lab: $(STAMP)  ## JupyterLab on labs/ for the learner (start with labs/README.md)
	$(VENV)/bin/jupyter lab --allow-root --ServerApp.root_dir=labs $(LAB_ARGS)
