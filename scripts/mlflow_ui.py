"""Open the MLflow UI on the runs table of the training experiment (`make mlflow-ui`).

python scripts/mlflow_ui.py [--store outputs/mlflow.db] [--experiment goodput] [--port 5000]

MLflow 3 opens an experiment in its GenAI view (traces, token usage) unless told otherwise: the UI
reads the URL parameter `workflowType=machine_learning` (and, with the workflow switch off, the
experiment tag `mlflow.experimentKind=custom_model_development`, which goodput sets on the
experiments it creates). This prints the URL of the experiment's runs table with that parameter,
tags an existing experiment that has no kind yet, then runs `mlflow ui`.
"""

import argparse
import os
import sys

from mlflow.tracking import MlflowClient

from goodput.tracking import KIND_TAG, KIND_TRAINING


def runs_url(host: str, port: int, experiment_id: str | None) -> str:
    base = f"http://{host}:{port}/#/experiments"
    return f"{base}/{experiment_id}/runs?workflowType=machine_learning" if experiment_id else base


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", default="outputs/mlflow.db", help="the SQLite store (mlflow.tracking_uri)")
    p.add_argument("--experiment", default="goodput", help="mlflow.experiment")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--print-url", action="store_true", help="print the URL and exit")
    a = p.parse_args()
    uri = f"sqlite:///{os.path.abspath(a.store)}"
    exp_id = None
    if os.path.exists(a.store):
        client = MlflowClient(uri)
        exp = client.get_experiment_by_name(a.experiment)
        if exp is not None:
            exp_id = exp.experiment_id
            if KIND_TAG not in exp.tags:  # made before goodput tagged its experiments
                client.set_experiment_tag(exp_id, KIND_TAG, KIND_TRAINING)
    url = runs_url(a.host, a.port, exp_id)
    print(f"MLflow UI: {url}", flush=True)
    if a.print_url:
        return
    mlflow = os.path.join(os.path.dirname(sys.executable), "mlflow")
    os.execv(mlflow, [mlflow, "ui", "--backend-store-uri", uri, "--host", a.host, "--port", str(a.port)])


if __name__ == "__main__":
    main()
