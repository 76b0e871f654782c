"""SGLang integration: the JETFLOW speculative algorithm as an SGLang plugin (see docs/SERVING.md).

Nothing is imported here on purpose: `cpu.boot` runs from a .pth hook at interpreter start and must stay cheap;
`plugin.register` is SGLang's entry point and imports SGLang lazily."""
