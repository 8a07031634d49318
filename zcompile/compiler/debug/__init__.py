"""What users read to debug a schedule: graph dumps and timelines (`dump`), the ranks' agreement on each graph's
collective schedule (`schedule_check`), and AOTAutograd's logs kept quiet (`aot_graph_logs`)."""
