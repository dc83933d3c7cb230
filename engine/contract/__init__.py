"""What the gateway and the engine process share, importable without torch: the records on the rings
(records), the rings themselves (rings), the lifeline that ends an orphaned engine (lifeline), the settings
the gateway hands the engine (settings) and the model's fixed numbers (constants)."""
