"""Placeholder until the dashboard issue lands: lists the runs in QAE_RUNS_DIR."""

import os
from pathlib import Path

import streamlit as st

from qae_app.store import read_runs

st.set_page_config(page_title="qae", layout="wide")
st.title("qae runs")
st.dataframe(read_runs(Path(os.environ.get("QAE_RUNS_DIR", "runs"))))
