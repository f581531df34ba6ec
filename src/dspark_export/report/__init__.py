"""The engine report: one self-contained HTML page with PNG figures (`dspark-export report`)."""

from .render import REPORT_DIR, ReportInputs, collect, load_json_input, render, render_into_manifest, write_report

__all__ = ["REPORT_DIR", "ReportInputs", "collect", "load_json_input", "render", "render_into_manifest",
           "write_report"]
