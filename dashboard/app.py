"""The qae dashboard: `qae dashboard --runs-dir DIR` (or `QAE_RUNS_DIR=DIR streamlit run dashboard/app.py`).

This entry point draws the sidebar shared by every page (the runs to show, bound to `?run=...`, and the refresh
interval) and hands over to the page picked in the navigation. Pages live in `views/` and stay thin: data comes from
`board` (cached store readers), figures from `charts`.
"""

import streamlit as st

import board

st.set_page_config(page_title="qae", page_icon=":material/monitoring:", layout="wide")

PAGES = [
    st.Page("views/runs.py", title="Runs", icon=":material/table_rows:", default=True),
    st.Page("views/curves.py", title="Training curves", icon=":material/show_chart:", url_path="curves"),
    st.Page("views/rollouts.py", title="Rollouts", icon=":material/chat:", url_path="rollouts"),
    st.Page("views/prompts.py", title="Prompt history", icon=":material/history:", url_path="prompts"),
    st.Page("views/evals.py", title="Evaluations", icon=":material/fact_check:", url_path="evals"),
]

page = st.navigation(PAGES)
with st.sidebar:
    st.caption(f"runs in `{board.runs_dir()}`")
    board.pick_runs(board.runs())
    st.selectbox("Refresh live runs every", list(board.REFRESH_CHOICES), key="refresh",
                 index=list(board.REFRESH_CHOICES).index(board.DEFAULT_REFRESH),
                 help="Only the live parts of a page (curves, tables) are redrawn, and only while a shown run is "
                      "running. Each refresh opens each run's database read-only for a few milliseconds.")
page.run()
