"""What an operator looks at: the usage report (`vramsched top`), the pending-pod explainer
(`vramsched why`), the per-GPU metrics and what feeds them. Pure builders over the ledger plus
thin readers (a cluster file, the Kubernetes API, a running extender's `/state`)."""
