"""The qae dashboard: `qae dashboard --runs-dir DIR` (or `QAE_RUNS_DIR=DIR streamlit run dashboard/app.py`).

This entry point draws the sidebar shared by every page (the runs to show, bound to `?run=...`, the refresh interval
and the watcher that redraws the page when its runs change) and hands over to the page picked in the navigation.
Pages live in `views/` and stay thin: data comes from `board` (cached store readers), figures from `charts`.
"""

import board
import streamlit as st

st.set_page_config(page_title="qae", page_icon=":material/monitoring:", layout="wide")

RUNS_PAGE = st.Page("views/runs.py", title="Runs", icon=":material/table_rows:", default=True)
COMPARE_URL = "compare"
COMPARE_PAGE = st.Page("views/compare.py", title="Compare", icon=":material/compare_arrows:", url_path=COMPARE_URL)
PAGES = [
    RUNS_PAGE,
    st.Page("views/curves.py", title="Training curves", icon=":material/show_chart:", url_path="curves"),
    st.Page("views/distributions.py", title="Distributions", icon=":material/bar_chart:", url_path="distributions"),
    st.Page("views/rollouts.py", title="Rollouts", icon=":material/chat:", url_path="rollouts"),
    st.Page("views/prompts.py", title="Prompt history", icon=":material/history:", url_path="prompts"),
    st.Page("views/evals.py", title="Evaluations", icon=":material/fact_check:", url_path="evals"),
    st.Page("views/eval_samples.py", title="Eval samples", icon=":material/quiz:", url_path="eval-samples"),
    st.Page("views/preview.py", title="Preview", icon=":material/preview:", url_path="preview"),
    COMPARE_PAGE,
]
# pages about runs beyond the ones picked in the sidebar (every run; a sweep's runs) watch every run
WATCH_ALL = ("", COMPARE_URL)  # "": the default page (Runs); strings, as a Page's url_path needs a running app

# The picked runs' chips show each run's whole id, wrapped between lines, never cut: cut at the sidebar's width, the
# seeds of a sweep (sweep-3f9a1c-qae-k0.4-s0, ...-s1) all read "sweep-3f9a1c-qae-…". (Streamlit's multiselect has no
# such option; the chip keeps its title, the whole id on hover.)
WHOLE_CHIPS = """<style>
[data-testid="stSidebar"] [data-testid="stMultiSelect"] [data-tag] { height: auto; white-space: normal; }
[data-testid="stSidebar"] [data-testid="stMultiSelect"] [data-tag] span[title] {
  white-space: normal; overflow-wrap: anywhere; text-overflow: clip; }
</style>"""

page = st.navigation(PAGES)
with st.sidebar:
    st.html(WHOLE_CHIPS)
    st.caption(f"runs in `{board.runs_dir()}`")
    all_runs = board.runs()
    shown = board.pick_runs(all_runs)
    board.picked_apart(all_runs, shown)
    starting_refresh, refresh_problem = board.starting_refresh()  # `qae dashboard --refresh`
    st.selectbox(
        "Refresh live runs every",
        list(board.REFRESH_CHOICES),
        key="refresh",
        index=list(board.REFRESH_CHOICES).index(starting_refresh),
        help="How often to check for new steps and new runs (two file stats per run, no database "
        "opened). A page is redrawn only when something it shows changed.",
    )
    if refresh_problem:
        st.warning(refresh_problem, icon=":material/warning:")
    # the runs page lists every run, the compare page a sweep's runs; the other pages show the picked ones
    board.watch(list(all_runs["run_id"]) if page.url_path in WATCH_ALL else shown, all_runs)
# a link's run this folder does not have is said on the page; a page about the picked runs then draws nothing else
# (never another run in its place); the Runs page still lists the runs there are, Compare picks its own
if page.url_path != COMPARE_URL and board.unknown_notice() and page.url_path not in WATCH_ALL:
    st.stop()
page.run()
