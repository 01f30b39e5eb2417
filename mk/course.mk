# The course: nbgrader labs built from solutions/ (included by the main Makefile, which defines VENV, PY, STAMP).
#
#   make labs   solutions/labNN/labNN.py -> solutions/labNN/labNN.ipynb -> labs/labNN/labNN.ipynb
#               (jupytext source -> nbgrader source notebook -> `nbgrader generate_assignment labNN --force`)
#   make lab    JupyterLab on labs/ (start with labs/README.md)
#
# nbgrader shells out to `alembic` when it creates its gradebook, so the venv's bin goes on PATH.

LAB_ARGS ?= --no-browser
COURSE_PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: labs lab

labs: $(STAMP)
	PATH="$(COURSE_PATH)" $(PY) tools/build_notebooks.py --release

lab: $(STAMP)
	PATH="$(COURSE_PATH)" $(VENV)/bin/jupyter lab --allow-root --ServerApp.root_dir=labs $(LAB_ARGS)
