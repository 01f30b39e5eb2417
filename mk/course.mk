# The course: nbgrader labs built from solutions/ (included by the main Makefile, which defines VENV, PY, STAMP).
#
#   make labs   solutions/labNN/labNN.py -> solutions/labNN/labNN.ipynb -> labs/labNN/labNN.ipynb
#               (jupytext source -> nbgrader source notebook -> `nbgrader generate_assignment labNN --force`,
#               run from the repository root so nbgrader reads nbgrader_config.py)
#   make lab    JupyterLab on work/, the learner's copy of labs/ (start with README.md, which opens rendered); LAB_ARGS adds
#               server flags, e.g. make lab LAB_ARGS="--no-browser --ip 0.0.0.0 --port 8888"
#   make instructor  JupyterLab on the repository with nbgrader's instructor tools (create assignment, formgrader)
#
# mk/jupyter/settings/overrides.json (installed as the venv's JupyterLab settings overrides, <app dir>/settings, where
# JupyterLab reads them) opens Markdown files in the rendered preview and turns off the "Jupyter news?" pop-up and the
# update check (no requests to jupyter.org); mk/jupyter/learner/ is the learner's extra Jupyter config dir: its
# page_config.json hides nbgrader's instructor plugins (validate stays), and the formgrader server extension is
# switched off.

LAB_ARGS ?= --no-browser
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings/overrides.json
NBGRADER_SERVER := nbgrader.server_extensions

.PHONY: labs lab instructor

labs: $(STAMP)  ## (instructors) rebuild solutions/*.ipynb and labs/ from solutions/labNN/labNN.py; FORCE=1 if labs/ was edited
	$(PY) tools/build_notebooks.py --release $(if $(FORCE),--overwrite-edited)

$(LAB_SETTINGS): mk/jupyter/settings/overrides.json $(STAMP)
	mkdir -p $(dir $@) && cp $< $@

# The learner's notebooks live in work/ (not tracked by git): `make lab` copies there what work/ lacks from labs/ and
# never overwrites a file in it, so no target can erase a saved answer.
lab: $(STAMP) $(LAB_SETTINGS)  ## JupyterLab on work/, your copy of the labs (start with README.md there)
	$(PY) tools/build_notebooks.py --workspace
	JUPYTER_CONFIG_PATH=$(abspath mk/jupyter/learner) $(VENV)/bin/jupyter lab --allow-root \
		--ServerApp.root_dir=work \
		--ServerApp.jpserver_extensions="{'$(NBGRADER_SERVER).formgrader': False, '$(NBGRADER_SERVER).course_list': False}" \
		$(LAB_ARGS)

instructor: $(STAMP) $(LAB_SETTINGS)  ## JupyterLab on the repository with nbgrader's instructor tools (formgrader)
	$(VENV)/bin/jupyter lab --allow-root --ServerApp.root_dir=. $(LAB_ARGS)
