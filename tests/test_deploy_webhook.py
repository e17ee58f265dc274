"""deploy/webhook.yaml: the admission webhook is scoped to vramsched's pods, never blocks pod
creation, and its Service reaches the extender's webhook listener as the Deployment starts it.
"""

from __future__ import annotations

from typing import Any

from deploy_objects import (
    base_objects,
    container,
    deployment,
    one,
    scheduler_config,
    serve_args,
)

from extender.webhook.launch import check_arguments
from extender.webhook.server import MUTATE_PATH


def webhook_configuration() -> dict[str, Any]:
    return one(base_objects(), "MutatingWebhookConfiguration", "vramsched")


def test_webhook_is_scoped_to_vramsched_pods_and_never_blocks_creation() -> None:
    (hook,) = webhook_configuration()["webhooks"]
    profile = scheduler_config()["profiles"][0]["schedulerName"]
    assert (hook["failurePolicy"], hook["sideEffects"]) == ("Ignore", "None")
    assert hook["admissionReviewVersions"] == ["v1"]
    assert hook["rules"] == [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "operations": ["CREATE"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    (condition,) = hook["matchConditions"]
    assert condition["expression"] == f"object.spec.schedulerName == '{profile}'"
    assert hook["timeoutSeconds"] <= 10


def test_webhook_service_reaches_the_extenders_webhook_listener() -> None:
    (hook,) = webhook_configuration()["webhooks"]
    ref = hook["clientConfig"]["service"]
    assert ref["path"] == MUTATE_PATH
    assert "caBundle" not in hook["clientConfig"]  # written by vramsched at start-up
    svc = one(base_objects(), "Service", ref["name"])
    assert svc["metadata"]["namespace"] == ref["namespace"]
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]]
    dep = deployment()
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    ext = container(dep, "extender")
    ports = {p["name"]: p["containerPort"] for p in ext["ports"]}
    args = serve_args(ext["args"])
    check_arguments(args)  # SystemExit if the flags could not work together
    assert ports[port["targetPort"]] == args.webhook_port
    assert args.webhook_host == "0.0.0.0"
    assert args.webhook_service == f"{ref['name']}.{ref['namespace']}"
    assert args.webhook_configuration == webhook_configuration()["metadata"]["name"]
    role = one(base_objects(), "Role", "vramsched-webhook-certificate")
    namespace, secret = args.webhook_secret.split("/")
    assert namespace == role["metadata"]["namespace"]
    assert [secret] == [r for rule in role["rules"] for r in rule.get("resourceNames", [])][:1]
